"""The steps a trial runs, on random inputs at a batch size: train.py's update and its evaluation forward.

Both are built on the run's own stack (`timm_ext.train.stack`) and loop (`timm_ext.train.loop.TrainLoop`) and hold
what DDP would hold besides (a buffer the size of the gradients for its buckets). The training trial
(`timm_ext.probe.trial`) runs them on the device; the memory estimate (`timm_ext.memory_model.estimate`) traces the update
on fake tensors.
"""
import argparse
from typing import Callable, ContextManager, List, Tuple

import torch

from ..errors import UsageError
from .loop import LoopConfig, TrainLoop
from .setup import mixup_active
from .stack import TrainingStack

__all__ = ['schedule_inputs', 'probe_input_size', 'trial_loop', 'trial_train_step', 'trial_eval_forward', 'trial_eval_step']


def schedule_inputs(args: argparse.Namespace, channels: int) -> List[Tuple[int, int, int]]:
    """The (C, H, W) of each `--train-img-sizes` entry, in the schedule's order (none without a schedule)."""
    inputs = []
    for size in getattr(args, 'train_img_sizes', None) or ():
        height, width = (size, size) if isinstance(size, int) else tuple(size)[-2:]
        inputs.append((channels, int(height), int(width)))
    return inputs


def probe_input_size(args: argparse.Namespace, data_config: dict) -> Tuple[int, ...]:
    """The largest input (C, H, W) the run will train on: the model's / --input-size / --img-size, or the biggest
    of a --train-img-sizes schedule (the first of equal ones)."""
    model_input = tuple(data_config['input_size'])
    return max([model_input, *schedule_inputs(args, model_input[0])], key=lambda size: size[1] * size[2])


def trial_loop(args: argparse.Namespace, stack: TrainingStack, device: torch.device) -> TrainLoop:
    """train.py's loop over `stack` as a trial runs it: one micro-batch an update, inputs already on the device."""
    return TrainLoop(
        stack.task, stack.optimizer,
        LoopConfig(device=device, clip_grad=args.clip_grad, clip_mode=args.clip_mode,
                   channels_last=args.channels_last, model_dtype=stack.model_dtype, prefetcher=True),
        amp_autocast=stack.amp.autocast,
    )


def trial_train_step(args: argparse.Namespace, stack: TrainingStack, loop: TrainLoop,
                     input_size: Tuple[int, ...], device: torch.device) -> Callable[[int], None]:
    """One training update of random inputs at a batch size, holding what DDP would hold besides (the trial's step,
    and the memory estimate's on fake tensors)."""
    task, model_dtype = stack.task, stack.model_dtype
    bucket_bytes = _ddp_bucket_bytes(args, stack)
    prefetched = 0 if args.no_prefetcher else 1  # the prefetcher holds the next batch while the model runs
    splits = max(1, args.aug_splits)  # AugMix splits put `splits` views of each image into a batch
    num_classes = stack.resolved.num_classes
    soft = mixup_active(args)
    updates = [0]

    def step(batch_size: int) -> None:
        if num_classes < 1:  # an encoder without a head: its features are no logits, nor is any target a class of them
            raise UsageError(f'{args.model} has no classifier head (num_classes {num_classes}); '
                             f'pass --num-classes N to train it with one')
        rows = batch_size * splits
        buckets = torch.empty(bucket_bytes, dtype=torch.uint8, device=device) if bucket_bytes else None
        input = torch.randn((rows,) + tuple(input_size), device=device, dtype=model_dtype or torch.float32)
        if soft:
            target = torch.full((rows, num_classes), 1.0 / num_classes, device=device)
        else:
            target = torch.randint(0, num_classes, (rows,), device=device)
        input, target = loop.prepare_batch(input, target)
        held = [(torch.empty_like(input), torch.empty_like(target)) for _ in range(prefetched)]
        loop.forward_backward(input, target, weight=1.0, sync=True)
        loop.optimizer_update()
        updates[0] += 1
        task.update_ema(step=updates[0])
        del buckets, held

    return step


def _ddp_bucket_bytes(args: argparse.Namespace, stack: TrainingStack) -> int:
    """DDP's gradient buckets, about one more copy of the gradients, resident for the whole run (evaluation
    included); 0 on one process."""
    if args.world_size <= 1:
        return 0
    return sum(p.numel() * p.element_size() for p in stack.task.get_trainable_module().parameters()
               if p.requires_grad)


def trial_eval_forward(args: argparse.Namespace, stack: TrainingStack, eval_input_size: Tuple[int, ...],
                       device: torch.device, no_grad: Callable[[], ContextManager] = torch.inference_mode
                       ) -> Callable[[int], None]:
    """One evaluation forward of random inputs at a batch size, as train.py evaluates between epochs.

    `no_grad`: the context without autograd; the memory estimate traces under `torch.no_grad`, where composite ops
    (linear, layer_norm) still decompose into the ops that hold their temporaries (`inference_mode` hands them to
    the trace whole, their copies of a permuted input unseen); what a forward holds is the same in both.
    """
    eval_model, model_dtype = stack.task.get_eval_model(), stack.model_dtype
    prefetched = 0 if args.no_prefetcher else 1  # the prefetcher holds the next batch while the model runs
    bucket_bytes = _ddp_bucket_bytes(args, stack)

    def forward(batch_size: int) -> None:
        shape = (batch_size,) + eval_input_size
        buckets = torch.empty(bucket_bytes, dtype=torch.uint8, device=device) if bucket_bytes else None
        held = [torch.randn(shape, device=device, dtype=model_dtype) for _ in range(prefetched)]
        input = torch.randn(shape, device=device, dtype=model_dtype)
        if args.channels_last:
            input = input.contiguous(memory_format=torch.channels_last)
        eval_model.eval()
        try:
            with no_grad(), stack.amp.autocast():
                eval_model(input)
        finally:
            eval_model.train()
        del input, held, buckets

    return forward


def trial_eval_step(stack: TrainingStack, train_step: Callable[[int], None],
                    forward: Callable[[int], None]) -> Callable[[int], None]:
    """The eval-batch probe's step: `forward` with the optimizer state allocated, as when train.py evaluates."""
    optimizer = stack.optimizer

    def eval_step(batch_size: int) -> None:
        if not optimizer.state:  # train.py evaluates with the optimizer state allocated: a tiny update makes it
            train_step(2)  # (batch norm needs 2 samples)
        forward(batch_size)

    return eval_step
