"""The training trial of the batch probe: one real update of the run's model, built the way train.py builds it.

`build_train_trial` takes train.py's parsed arguments and sets up what decides a training step's memory with
train.py's own builder (`timm_ext.train.stack`) and loop (`timm_ext.train.loop.TrainLoop`): the model with its
dtype, channels_last and gradient checkpointing, the task and loss, the optimizer (`create_optimizer_v2`), the EMA
copy, AMP and the gradient scaler, torch.compile. A trial at batch size b then runs a warm-up (an update, which
allocates the optimizer state, and the eval pass in shapes, below) and timed updates, on random inputs of the
largest size the run will see, directly on the device, holding the prefetcher's next batch as train.py's loader does.
Under DDP the trial (the evaluation forward too) adds a buffer the size of the gradients for DDP's gradient buckets,
resident for the whole run, but runs no collective inside the step, so a rank that fails alone cannot leave the
others waiting.

Three things differ from the run on purpose, each to keep a trial one honest, self-contained step:

* `--sync-bn` is probed with plain BatchNorm: SyncBatchNorm all-gathers statistics in every forward and backward
  once a process group exists, a collective inside the step; the memory differs only by those tiny buffers.
* float16 AMP's loss scaler starts at `PROBE_LOSS_SCALE` (1), not 65536: a fresh scaler's first updates overflow
  and skip the optimizer step, which then allocates no optimizer state and times a cheaper step than the run's.
* `--torchcompile-mode` with CUDA graphs ('reduce-overhead', 'max-autotune') is probed without them
  (`probe_compile_mode`): CUDA graph trees record every graph of the device into one memory pool
  (torch/_inductor/cudagraph_trees.py), which keeps its segments and the last replay's outputs between steps and
  which `empty_cache` does not release, so every trial would also pay for what the sizes tried before it left there.
  Memory is the same but for the graphs' static input copies and what the pool keeps; step times lack the launch
  overhead the graphs save (small batches).

A trial's warm-up (`TrainTrialSetup.warmup`) is train.py's first epoch boundary in small: one update, then one
evaluation forward at every batch shape train.py's eval pass runs (the eval batch, and the smaller last batch of the
split, `eval_batch_shapes`), then the timed updates. On CPU oneDNN caches each shape's kernels with their buffers for
the life of the process, so train.py's second epoch trains with the eval pass's shapes resident: test_resnet at
32 px, batch 19, peaked 41.7 MiB in its first epoch and 49.7 MiB after the first eval, while a trial of updates only
measured 41.9 MiB, and the chosen batch ran out of memory in train.py under the probe's own cap.

With `--torchcompile` on the CPU the trials' compiled modules take the batch dimension dynamic (`BatchDynamic`):
every trial runs in a fork of its own, and one graph for all batch sizes lets each load what the first compiled from
inductor's disk cache instead of compiling again (`timm_ext.probe.compiled_trials`).

The same setup also times the run's evaluation step (`TrainTrialSetup.eval_trials`): a forward pass without
gradients of the eval model at the eval input size, with the optimizer state resident as it is when train.py
evaluates between epochs; tune_batch.py probes it for `validation_batch_size`.

The steps themselves are in `timm_ext.train.trial_steps`; `timm_ext.probe.train_probe` runs the whole probe.
"""
import argparse
import dataclasses
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ..cuda_backends import CUDA_GRAPH_MODES
from ..memory import steady_cpu_heap
from ..train.setup import SetupError, with_values
from ..train.stack import TrainingStack, build_training_stack
from ..train.trial_steps import (probe_input_size, schedule_inputs, trial_eval_forward, trial_eval_step, trial_loop,
                                 trial_train_step)
from .compiled_trials import BatchDynamic, graph_cache_on

__all__ = ['TrainTrialSetup', 'build_train_trial', 'probe_grad_scaler',
           'probe_compile_mode', 'PROBE_LOSS_SCALE', 'eval_batch_shapes']

# Initial loss scale of the probe's float16 scaler: unscaled, an update overflows only when the run's would at any
# scale, so no trial skips its optimizer step (gradients that underflow to zero cost the same step).
PROBE_LOSS_SCALE = 1.0


def probe_grad_scaler(device: torch.device) -> torch.amp.GradScaler:
    """A fresh loss scaler for a trial, starting at `PROBE_LOSS_SCALE` so its updates are not skipped."""
    return torch.amp.GradScaler(device.type, init_scale=PROBE_LOSS_SCALE)


def probe_compile_mode(mode: Optional[str]) -> Optional[str]:
    """The torch.compile mode probe trials use for the run's `--torchcompile-mode`: the same, less CUDA graphs."""
    return CUDA_GRAPH_MODES.get(mode, mode)


@dataclass
class TrainTrialSetup:
    """What a training trial runs: built once, reused by every trial.

    Attributes:
        step: Runs one training update at a batch size (raises on failure).
        reset: Clears gradients, optimizer state and the loss scaler (before and after each trial).
        input_size: (C, H, W) of the trial inputs.
        describe: One line naming the model, input, precision and optimizer (for reports and errors).
        device: The device trials run on.
        eval_step: Runs one evaluation forward at a batch size (no gradients), the optimizer state allocated.
        eval_input_size: (C, H, W) train.py evaluates at.
        eval_forward: One evaluation forward at a batch size, nothing else (the warm-up's eval pass).
        eval_batch_size: train.py's --validation-batch-size (None: it evaluates at the training batch).
        eval_samples: Samples of the eval split, whose remainder makes the eval pass's last, smaller batch: 0 when
            train.py will not evaluate, None when unknown (the warm-up then evaluates at the eval batch only).
        world_size: Ranks the eval split is shared over.
        train_step: The training update (`step` of a training trial; kept when `eval_trials` replaces `step`).
        train_batch: Eval-batch trials only: the run's training micro-batch, trained at around the eval pass.
        args: train.py's arguments the setup was built from, so that another process can build it again
            (`timm_ext.probe.trial_host`); None for a setup built otherwise.
        phase: 'train', or 'eval' for `eval_trials`.
        batch_dynamic: The marks that make the compiled modules' batch dimension dynamic (`BatchDynamic`): compiled
            CPU trials only, else None.
    """
    step: Callable[[int], None]
    reset: Callable[[], None]
    input_size: Tuple[int, ...]
    describe: str
    device: torch.device
    eval_step: Optional[Callable[[int], None]] = None
    eval_input_size: Optional[Tuple[int, ...]] = None
    eval_forward: Optional[Callable[[int], None]] = None
    eval_batch_size: Optional[int] = None
    eval_samples: Optional[int] = None
    world_size: int = 1
    train_step: Optional[Callable[[int], None]] = None
    train_batch: Optional[int] = None
    args: Optional[argparse.Namespace] = None
    phase: str = 'train'
    batch_dynamic: Optional[BatchDynamic] = None

    def warmup(self, batch_size: int) -> None:
        """The trial's untimed first part, train.py's epoch boundary: a training trial runs one update, then the eval
        pass in shapes (see the module doc); an eval-batch trial (`eval_trials`) trains at the run's batch, runs the
        eval pass at `batch_size`, and trains again (the next epoch, with the eval shapes resident)."""
        if self.train_batch is None:
            self.step(batch_size)
            self._eval_pass(self.eval_batch_size or batch_size)
        else:
            self.train_step(self.train_batch)
            self.step(batch_size)
            self._eval_pass(batch_size, skip_first=True)
            self.train_step(self.train_batch)

    def _eval_pass(self, eval_batch: int, skip_first: bool = False) -> None:
        """One evaluation forward at each batch shape of train.py's eval pass (none without `eval_forward`)."""
        if self.eval_forward is not None:
            for rows in eval_batch_shapes(eval_batch, self.eval_samples, self.world_size)[int(skip_first):]:
                self.eval_forward(rows)

    def eval_trials(self, train_batch: Optional[int] = None) -> 'TrainTrialSetup':
        """The same run's evaluation step as the trial (for `probe_train_batch`).

        Args:
            train_batch: The run's training micro-batch, once chosen: the warm-up then trains at it around the eval
                pass, so the peak counts train.py's next epoch with the eval batch's shapes resident. None: the eval
                forward alone, after a tiny update that allocates the optimizer state.
        """
        if self.eval_step is None:
            raise ValueError('this setup was built without an evaluation step')
        return dataclasses.replace(self, step=self.eval_step, input_size=self.eval_input_size,
                                   eval_forward=self.eval_forward if train_batch else None, train_batch=train_batch,
                                   phase='eval',
                                   describe=f'{self.describe}; evaluation forward (no gradients) at input '
                                            f'{"x".join(map(str, self.eval_input_size))}'
                                            + (f' between updates at batch {train_batch}' if train_batch else ''))


def eval_batch_shapes(eval_batch: int, eval_samples: Optional[int], world_size: int = 1) -> List[int]:
    """The batch sizes train.py's eval pass runs on one rank: the eval batch, then the split's smaller remainder.

    Args:
        eval_batch: The eval loader's batch size.
        eval_samples: Samples in the eval split; 0: no eval pass; None: unknown (the eval batch alone).
        world_size: Ranks; timm's distributed eval sampler pads the split to a multiple of it.
    """
    if eval_samples is None:
        return [eval_batch]
    per_rank = -(-eval_samples // max(1, world_size))
    full, rest = divmod(per_rank, eval_batch)
    return ([eval_batch] if full else []) + ([rest] if rest else [])


def build_train_trial(args: argparse.Namespace, device: torch.device) -> TrainTrialSetup:
    """Set up the run's model, task, optimizer, EMA and AMP for training trials.

    `args` is train.py's namespace (after `init_device`, so rank and world size are set); it is not modified.

    Raises:
        SetupError: The run cannot be built (unknown model, ...) or is a mode the probe does not cover (NaFlex).
    """
    if getattr(args, 'naflex_loader', False):
        raise SetupError('--naflex-loader runs take variable patch sequences; the probe covers fixed-size inputs, '
                         'so pass -b/--batch-size yourself')
    compile_mode = probe_compile_mode(args.torchcompile_mode)
    # no collective inside a trial: SyncBN is probed as plain BN, whose memory lacks only SyncBN's tiny buffers; the
    # value of the LR does not change memory, but the optimizer factory needs one
    stack = build_training_stack(with_values(args, sync_bn=False), device, lr=args.lr or args.lr_base,
                                 with_data=False, compile_mode=compile_mode, ddp=False)
    loop = trial_loop(args, stack, device)
    input_size = probe_input_size(args, stack.data_config)
    step = trial_train_step(args, stack, loop, input_size, device)
    eval_input_size = tuple(stack.data_config['input_size'])  # train.py's eval loader: the model's input size

    def reset() -> None:
        if device.type == 'cpu':  # in the trial's own child (CPU trials are forked): its peak as a capped run's
            steady_cpu_heap()
        stack.optimizer.zero_grad(set_to_none=True)
        stack.optimizer.state.clear()
        loop.grad_scaler = probe_grad_scaler(device) if stack.amp.use_grad_scaler else None

    forward = trial_eval_forward(args, stack, eval_input_size, device)
    # CPU trials run in forks that share compiled graphs only through the disk cache: one graph for every batch size
    batch_dynamic = BatchDynamic(stack.task) if args.torchcompile and device.type == 'cpu' and graph_cache_on() \
        else None
    describe = _describe_trial(args, stack, input_size, compile_mode, batch_dynamic is not None)
    return TrainTrialSetup(step, reset, tuple(input_size), describe, device, trial_eval_step(stack, step, forward),
                           eval_input_size, forward, args.validation_batch_size, None, max(1, args.world_size), step,
                           args=args, batch_dynamic=batch_dynamic)


def _describe_trial(args: argparse.Namespace, stack: TrainingStack, input_size: Tuple[int, ...],
                    compile_mode: Optional[str], batch_dynamic: bool) -> str:
    """One line naming the model, input, precision, optimizer and what the trial changes from the run."""
    amp = stack.amp
    precision = f'AMP {amp.dtype}'.replace('torch.', '') if amp.enabled else str(stack.model_dtype or 'float32')
    graphs_dropped = bool(args.torchcompile) and compile_mode != args.torchcompile_mode
    sync_bn_asked = args.sync_bn and args.distributed
    extras = [x for x, on in (('channels_last', args.channels_last), ('grad checkpointing', args.grad_checkpointing),
                              ('EMA', args.model_ema), ('torch.compile', args.torchcompile),
                              ('no CUDA graphs in trials', graphs_dropped),
                              ('batch dimension dynamic in trials', batch_dynamic),
                              ('SyncBN probed as BN', sync_bn_asked)) if on]
    return (f'model {args.model} at input {"x".join(map(str, input_size))}, {precision}, optimizer {args.opt}'
            + (', ' + ', '.join(extras) if extras else ''))
