"""The steps a trial runs, on random inputs at a batch size: train.py's update and its evaluation forward.

Both are built on the run's own stack (`timm_ext.train.stack`) and loop (`timm_ext.train.loop.TrainLoop`) and hold
what DDP would hold besides: its reducer's gradient buckets (`DdpBuckets`), resident across steps as DDP keeps them,
one per dtype from the first step and rebuilt at its end in the order its backward made the gradients ready, as DDP
rebuilds them before its second forward, and the flat copies it broadcasts the buffers through before each training
forward (the rules: `timm_ext.train.ddp_buckets`). The training trial
(`timm_ext.probe.trial`) runs them on the device, a DDP rank emulated in one process; the memory estimate
(`timm_ext.memory_model.estimate`) traces the update on fake tensors, where the buckets are residents of the step.
"""
import argparse
import contextlib
import weakref
from typing import Callable, ContextManager, Iterator, List, Optional, Sequence, Tuple

import torch

from ..errors import UsageError
from .ddp_buckets import (BROADCAST_IN_FLIGHT, allocating_buckets, broadcast_bucket_sizes, initial_bucket_sizes,
                          rebuilt_bucket_sizes)
from .loop import LoopConfig, TrainLoop
from .setup import mixup_active
from .stack import TrainingStack

__all__ = ['schedule_inputs', 'probe_input_size', 'trial_loop', 'trial_train_step', 'trial_eval_forward',
           'trial_eval_step']


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
    buckets = _ddp_buckets(args, stack, device)
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
        if buckets is not None:
            buckets.hold()
        input = torch.randn((rows,) + tuple(input_size), device=device, dtype=model_dtype or torch.float32)
        if soft:
            target = torch.full((rows, num_classes), 1.0 / num_classes, device=device)
        else:
            target = torch.randint(0, num_classes, (rows,), device=device)
        input, target = loop.prepare_batch(input, target)
        held = [(torch.empty_like(input), torch.empty_like(target)) for _ in range(prefetched)]
        with buckets.update() if buckets is not None else contextlib.nullcontext():
            loop.forward_backward(input, target, weight=1.0, sync=True)
            loop.optimizer_update()  # DDP rebuilds its buckets after the update, before the next forward
            updates[0] += 1
            task.update_ema(step=updates[0])
            del held

    return step


class DdpBuckets:
    """DDP's gradient buckets on a rank as the trial holds them: allocated at the first step (DDP makes them at
    construction), one tensor per bucket, kept across steps and trials; and its buffer broadcast before each update.

    Args:
        params: The parameters DDP would wrap, in `parameters()` order.
        device: Where the buckets live.
        buffers: The module's buffers that DDP broadcasts before each training forward (none: `broadcast_buffers`
            off).
    """

    def __init__(self, params: Sequence[torch.Tensor], device: torch.device, buffers: Sequence[torch.Tensor] = ()):
        self.params = list(params)
        self.device = device
        self.buffers = list(buffers)
        self.tensors: Optional[List[torch.Tensor]] = None
        self.rebuilt = False

    def hold(self) -> None:
        """Allocate the construction's buckets (one per dtype) unless some are held."""
        if self.tensors is None:
            self.tensors = self._allocate(initial_bucket_sizes(self.params))

    @contextlib.contextmanager
    def update(self) -> Iterator[None]:
        """Around a training update: DDP's broadcast of the buffers before the forward; until the buckets are rebuilt,
        the order the gradients become ready in is recorded and they are rebuilt from it once the update is through
        (an update that fails records nothing)."""
        self._broadcast_buffers()
        if self.rebuilt:
            yield
            return
        ready: List[torch.Tensor] = []
        handles = [p.register_post_accumulate_grad_hook(ready.append) for p in self.params if p.requires_grad]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        got = {id(p) for p in ready}  # a parameter without a gradient (DDP would stop): last, to keep the total
        ready += [p for p in reversed(self.params) if p.requires_grad and id(p) not in got]
        self.tensors = None  # the reducer frees the construction's buckets before it makes the new ones
        self.tensors = self._allocate(rebuilt_bucket_sizes(ready))
        self.rebuilt = True

    def _broadcast_buffers(self) -> None:
        """The flat copies DDP broadcasts the buffers through (`broadcast_bucket_sizes`), at most
        `BROADCAST_IN_FLIGHT` alive at once, all freed before the forward runs."""
        in_flight: List[torch.Tensor] = []
        with allocating_buckets():
            for dtype, numel in broadcast_bucket_sizes(self.buffers):
                if len(in_flight) == BROADCAST_IN_FLIGHT:
                    del in_flight[0]  # the oldest broadcast is waited for before the next starts
                in_flight.append(torch.empty(numel, dtype=dtype, device=self.device))
        in_flight.clear()

    def _allocate(self, sizes: Sequence[Tuple[torch.dtype, int]]) -> List[torch.Tensor]:
        with allocating_buckets():
            return [torch.empty(numel, dtype=dtype, device=self.device) for dtype, numel in sizes]


_HELD_BUCKETS: 'weakref.WeakKeyDictionary[torch.nn.Module, DdpBuckets]' = weakref.WeakKeyDictionary()


def _ddp_buckets(args: argparse.Namespace, stack: TrainingStack, device: torch.device) -> Optional[DdpBuckets]:
    """The DDP buckets of the run's task (one set shared by its training and evaluation steps); None on one
    process."""
    if args.world_size <= 1:
        return None
    if stack.task not in _HELD_BUCKETS:
        module = stack.task.get_trainable_module()
        buffers = () if args.no_ddp_bb else module.buffers()  # train.py keeps DDP's broadcast_buffers unless told
        _HELD_BUCKETS[stack.task] = DdpBuckets(module.parameters(), device, buffers)
    return _HELD_BUCKETS[stack.task]


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
    buckets = _ddp_buckets(args, stack, device)

    def forward(batch_size: int) -> None:
        shape = (batch_size,) + eval_input_size
        if buckets is not None:
            buckets.hold()
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
        del input, held

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
