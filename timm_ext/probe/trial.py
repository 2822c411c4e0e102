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
  (`probe_compile_mode`): the graphs recorded for each batch size keep private memory pools that `empty_cache`
  does not release, so every trial would also pay for the pools of the sizes tried before it. Memory is the same
  but for the graphs' static input copies; step times lack the launch overhead the graphs save (small batches).

A trial's warm-up (`TrainTrialSetup.warmup`) is train.py's first epoch boundary in small: one update, then one
evaluation forward at every batch shape train.py's eval pass runs (the eval batch, and the smaller last batch of the
split, `eval_batch_shapes`), then the timed updates. On CPU oneDNN caches each shape's kernels with their buffers for
the life of the process, so train.py's second epoch trains with the eval pass's shapes resident: test_resnet at
32 px, batch 19, peaked 41.7 MiB in its first epoch and 49.7 MiB after the first eval, while a trial of updates only
measured 41.9 MiB, and the chosen batch ran out of memory in train.py under the probe's own cap.

The same setup also times the run's evaluation step (`TrainTrialSetup.eval_trials`): a forward pass without
gradients of the eval model at the eval input size, with the optimizer state resident as it is when train.py
evaluates between epochs; tune_batch.py probes it for `validation_batch_size`.

`probe_train_batch` runs the whole probe: budget, cap, the search aimed at the headroom's limit, re-timing
(throughput choice), choice.
"""
import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..cuda_backends import CUDA_GRAPH_MODES
from ..memory import MemoryBudget, PeakMeter, device_name, format_bytes, memory_cap
from .search import (
    ERROR, BatchGrid, Selection, Trial, TrialError, TrialFn, agree_across_ranks, headroom_accept,
    measured_trial, retime_trials, search_batch_size, select_batch_size, default_grid,
)
from ..train.loop import LoopConfig, TrainLoop
from ..train.setup import SetupError, mixup_active, with_values
from ..train.stack import TrainingStack, build_training_stack

__all__ = ['TrainTrialSetup', 'build_train_trial', 'trial_loop', 'trial_train_step', 'schedule_inputs',
           'probe_input_size', 'ProbeOutcome', 'probe_train_batch', 'probe_grad_scaler', 'probe_compile_mode',
           'PROBE_LOSS_SCALE', 'eval_batch_shapes', 'check_step_runs', 'budget_after_warmup']

_logger = logging.getLogger(__name__)

# Initial loss scale of the probe's float16 scaler: unscaled, an update overflows only when the run's would at any
# scale, so no trial skips its optimizer step (gradients that underflow to zero cost the same step).
PROBE_LOSS_SCALE = 1.0



def probe_grad_scaler(device: torch.device) -> torch.amp.GradScaler:
    """A fresh loss scaler for a trial, starting at `PROBE_LOSS_SCALE` so its updates are not skipped."""
    return torch.amp.GradScaler(device.type, init_scale=PROBE_LOSS_SCALE)


def probe_compile_mode(mode: Optional[str]) -> Optional[str]:
    """The torch.compile mode probe trials use for the run's `--torchcompile-mode`: the same, less CUDA graphs."""
    return CUDA_GRAPH_MODES.get(mode, mode)


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
        stack.optimizer.zero_grad(set_to_none=True)
        stack.optimizer.state.clear()
        loop.grad_scaler = probe_grad_scaler(device) if stack.amp.use_grad_scaler else None

    forward = _eval_forward(args, stack, eval_input_size, device)
    return TrainTrialSetup(step, reset, tuple(input_size), _describe_trial(args, stack, input_size, compile_mode),
                           device, _eval_step(stack, step, forward), eval_input_size, forward,
                           args.validation_batch_size, None, max(1, args.world_size), step)


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


def _eval_forward(args: argparse.Namespace, stack: TrainingStack, eval_input_size: Tuple[int, ...],
                  device: torch.device) -> Callable[[int], None]:
    """One evaluation forward of random inputs at a batch size, as train.py evaluates between epochs."""
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
            with torch.inference_mode(), stack.amp.autocast():
                eval_model(input)
        finally:
            eval_model.train()
        del input, held, buckets

    return forward


def _eval_step(stack: TrainingStack, train_step: Callable[[int], None],
               forward: Callable[[int], None]) -> Callable[[int], None]:
    """The eval-batch probe's step: `forward` with the optimizer state allocated, as when train.py evaluates."""
    optimizer = stack.optimizer

    def eval_step(batch_size: int) -> None:
        if not optimizer.state:  # train.py evaluates with the optimizer state allocated: a tiny update makes it
            train_step(2)  # (batch norm needs 2 samples)
        forward(batch_size)

    return eval_step


def _describe_trial(args: argparse.Namespace, stack: TrainingStack, input_size: Tuple[int, ...],
                    compile_mode: Optional[str]) -> str:
    """One line naming the model, input, precision, optimizer and what the trial changes from the run."""
    amp = stack.amp
    precision = f'AMP {amp.dtype}'.replace('torch.', '') if amp.enabled else str(stack.model_dtype or 'float32')
    graphs_dropped = bool(args.torchcompile) and compile_mode != args.torchcompile_mode
    sync_bn_asked = args.sync_bn and args.distributed
    extras = [x for x, on in (('channels_last', args.channels_last), ('grad checkpointing', args.grad_checkpointing),
                              ('EMA', args.model_ema), ('torch.compile', args.torchcompile),
                              ('no CUDA graphs in trials', graphs_dropped),
                              ('SyncBN probed as BN', sync_bn_asked)) if on]
    return (f'model {args.model} at input {"x".join(map(str, input_size))}, {precision}, optimizer {args.opt}'
            + (', ' + ', '.join(extras) if extras else ''))


@dataclass
class ProbeOutcome:
    """A finished probe.

    Attributes:
        selection: The chosen batch and why, with the trial table.
        budget: The budget in bytes.
        describe: What was probed (model, input, precision, optimizer).
        device_name: The device's name.
        cached: Read from the probe cache (no trials ran).
    """
    selection: Selection
    budget: int
    describe: str
    device_name: str
    cached: bool = False

    @property
    def trials(self) -> List[Trial]:
        return self.selection.trials


def probe_train_batch(
        setup: TrainTrialSetup,
        budget: Union[MemoryBudget, int],
        headroom: float = 0.1,
        select: str = 'max',
        throughput_tol: float = 0.05,
        start: int = 2,
        max_batch: Optional[int] = None,
        grid: Optional[BatchGrid] = None,
        timed_steps: int = 1,
        on_trial: Optional[Callable[[Trial], None]] = None,
        retime_rounds: int = 2,
        prior: Optional[Tuple[float, float]] = None,
) -> ProbeOutcome:
    """Probe the largest training batch under a memory cap and choose one.

    The cap is in force only while trials run and is lifted however the probe ends. Under an initialized process
    group every rank must call this together: each trial's outcome is agreed across ranks, and the final size is
    the minimum over ranks.

    Args:
        setup: The training trial (`build_train_trial`).
        budget: The memory budget (`timm_ext.memory.parse_budget`), resolved after the first step; or its bytes,
            resolved by the caller (`budget_after_warmup`).
        headroom: Fraction of the budget the chosen batch must leave free, judged on measured peak memory.
        select: 'max' or 'throughput' (see `select_batch_size`).
        throughput_tol: Tolerance of the throughput choice.
        start: First batch size tried.
        max_batch: Largest batch worth trying (dataset size, --max-batch).
        grid: The sizes trials may take (default: multiples of the device's `default_batch_multiple`).
        timed_steps: Timed updates per trial after the warm-up update.
        on_trial: Called with each trial as it completes.
        retime_rounds: Throughput choice: interleaved rounds that time the close sizes, and the grid sizes the
            search skipped between them, again (`retime_trials`).
        prior: The memory estimate's peak line in this budget's units, to aim the first trial and calibrate
            (`search_batch_size`).

    Raises:
        BudgetError: The budget is larger than the device.
        NothingFitsError / TrialError: see `select_batch_size`; the message names the budget and the run.
    """
    device = setup.device
    # CPU trials run in forked processes, CUDA trials here (see `timm_ext.probe.search.run_forked`)
    isolate = device.type == 'cpu'
    if not isolate:
        check_step_runs(setup, start)  # on CUDA this first update also sets up kernels and library workspaces
    # resolved after that first update: what it took outside the allocator is no longer free for the budget
    budget_bytes = budget if isinstance(budget, int) else budget.resolve(device)
    context = f'{setup.describe}, budget {format_bytes(budget_bytes)} on {device_name(device)}'
    with memory_cap(device, budget_bytes) as cap:
        budget_bytes = cap.budget  # the cap in force (a CPU hard limit can hold it lower)
        trial: TrialFn = measured_trial(
            setup.step, device, PeakMeter(device, cap.baseline), warmup_steps=1, timed_steps=timed_steps,
            capped=True, before=setup.reset, isolate=isolate, warmup=setup.warmup,
            benchmark_warmup=device.type == 'cuda' and torch.backends.cudnn.enabled and torch.backends.cudnn.benchmark)
        trial = agree_across_ranks(trial)
        # every rank must judge and aim alike, so the headroom is taken of the smallest budget of any rank
        accept = headroom_accept(_smallest_over_ranks(budget_bytes, device), headroom)
        grid = grid or default_grid(device.type)
        trials = search_batch_size(trial, start, max_batch, grid, accept=accept, on_trial=on_trial,
                                   peak_limit=accept.limit, prior=prior)
        if select == 'throughput':
            trials += retime_trials(trial, trials, throughput_tol, retime_rounds, accept, on_trial, grid)
    if isolate and not any(t.accepted for t in trials):
        # a forked check warms nothing here, so it is spent only when no capped trial fit (every rank alike)
        check_step_runs(setup, start)
    selection = select_batch_size(trials, select, throughput_tol, context)
    # outcomes were agreed trial by trial, so this only guards against a rank that chose differently
    chosen = _smallest_over_ranks(selection.batch_size, device)
    if chosen != selection.batch_size:
        pick = next(t for t in trials if t.batch_size == chosen)
        selection = Selection(pick.batch_size, 'smallest choice over ranks', pick, trials)
    return ProbeOutcome(selection, budget_bytes, setup.describe, device_name(device))


def check_step_runs(setup: TrainTrialSetup, start: int = 2) -> None:
    """One uncapped trial at a tiny batch (all ranks together): a step that fails without any cap is the run's own
    failure, not an out-of-memory. On CUDA it also loads the step's kernels and library handles.

    Raises:
        TrialError: The step fails; one line naming the run.
    """
    uncapped = agree_across_ranks(measured_trial(setup.step, setup.device, before=setup.reset,
                                                 isolate=setup.device.type == 'cpu'))
    check = uncapped(min(start, 2))
    if check.status == ERROR:
        raise TrialError(f'a training step fails before any memory cap ({setup.describe} on '
                         f'{device_name(setup.device)}): {check.error}', [check])


def budget_after_warmup(setup: TrainTrialSetup, budget: MemoryBudget) -> int:
    """The budget in bytes as trials will see it: on CUDA resolved after one step has run (`check_step_runs`), since
    that step's kernels and library handles take memory outside the allocator that a fraction must not count."""
    if setup.device.type == 'cuda':
        check_step_runs(setup)
    return budget.resolve(setup.device)


def _smallest_over_ranks(value: int, device: torch.device) -> int:
    """The minimum of `value` over the ranks of an initialized process group (`value` itself without one)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = torch.tensor([value], dtype=torch.int64, device=device if dist.get_backend() == 'nccl' else 'cpu')
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return int(box.item())


def nothing_fits_advice(args: argparse.Namespace) -> str:
    """Suggestions for a run whose batch of 1-2 does not fit: the memory savers it is not using yet."""
    tips = []
    if not args.amp and not args.model_dtype:
        tips.append('--amp (mixed precision)')
    if not args.grad_checkpointing:
        tips.append('--grad-checkpointing')
    tips.append('a smaller --img-size / --input-size')
    if args.model_ema and not args.model_ema_force_cpu:
        tips.append('--model-ema-force-cpu')
    tips.append('a larger --mem-budget')
    return 'try ' + ', '.join(tips)

