"""``--batch-ramp``: the global batch follows the measured critical batch, re-planned at epoch boundaries.

The critical batch is small at initialisation and grows as the loss falls (McCandlish et al. 2018, "An Empirical
Model of Large-Batch Training"; Merrill et al. 2025 on batch-size warm-up). ``--log-noise-scale`` already measures
B_simple, an estimate of it, for free from accumulation windows or DDP ranks. At each epoch boundary the ramp grows
the accumulation to the largest one whose global batch stays within B_simple / factor, at most doubling it per
change, and never past the cap (enough optimizer updates for the run, an optional largest global batch).

McCandlish's model says a batch B needs ``E_min (1 + B / B_noise)`` samples for a given loss, so keeping the global
batch at or below B_simple / factor costs at most ``1 / factor`` more samples than the small-batch limit: with the
default factor 4 every sample keeps at least 80% of its small-batch value. Growth is capped at doubling per change
because the EMA of B_simple lags and is noisy, and an LR that jumps more than the batch doubles is a risk.

At each change the LR moves by the run's rule (`timm_ext.lr.rescale_lr`: linear, or sqrt for adaptive
optimizers), in the optimizer's groups and in the scheduler's bases, so warm-up and decay keep the recipe's shape.
Every epoch trains the same samples whatever the accumulation, so a per-epoch schedule needs nothing more; a
per-update one (``--sched-on-updates``) is driven through `RecipeClock` in the recipe's updates (samples trained
/ the recipe's global batch), so the schedule's length stays the recipe's in samples.

The global batch is split as micro-batch x accumulation by `split_global`: with ``--batch-ramp-max-micro`` (the
largest micro-batch per rank known to fit, e.g. the probe's) a bigger micro-batch comes before more accumulation,
because on a GPU samples/s grows with the micro-batch while accumulation only saves optimizer steps. A new
micro-batch means a new training loader (timm's has its batch size built in): `TrainLoaderRebuild` builds it with
the training stack's own builder. Without the flag only the accumulation grows.

The rule, the LR factor, the state and the log line are pure; `BatchRamp` applies them to a run's loop, optimizer
and scheduler.
"""
import argparse
import logging
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..accum import accumulation_windows, plan_accumulation
from ..lr import default_lr_scale, rescale_lr, scale_group_lrs
from .elastic import BatchLayout
from .noise_monitor import min_accum_steps
from .setup import batch_multiple, build_train_loader, with_values

__all__ = ['RAMP_FACTOR', 'MAX_GROWTH', 'RampChange', 'RampState', 'with_noise_scale', 'ramp_cap', 'plan_ramp',
           'split_global', 'lr_factor', 'describe_ramp_change', 'RecipeClock', 'TrainLoaderRebuild', 'BatchRamp']

_logger = logging.getLogger('train')

RAMP_FACTOR = 4.0  # the global batch stays within B_simple / this: at most 25% more samples than the small-batch limit
MAX_GROWTH = 2  # one change at most doubles the accumulation (the B_simple EMA lags and is noisy)


@dataclass(frozen=True)
class RampChange:
    """One change of the global batch.

    Attributes:
        epoch: The first epoch trained with the new layout.
        b_simple: The B_simple EMA (samples) the change followed.
        old_accum: Accumulation before the change.
        new_accum: Accumulation after it.
        old_global: Global batch before the change.
        new_global: Global batch after it.
        lr_factor: What the change multiplied the LR by.
        old_micro: Micro-batch per rank before the change (None in checkpoints from before it could grow).
        new_micro: Micro-batch per rank after it (None as `old_micro`).
    """
    epoch: int
    b_simple: float
    old_accum: int
    new_accum: int
    old_global: int
    new_global: int
    lr_factor: float
    old_micro: Optional[int] = None
    new_micro: Optional[int] = None


@dataclass
class RampState:
    """What a checkpoint keeps of the ramp (key ``batch_ramp``): the layout now, the recipe's, the changes.

    Attributes:
        accum_steps: The accumulation the run trains with now.
        recipe_accum: The recipe's accumulation (--grad-accum-steps), the start of the ramp.
        history: The changes so far, oldest first.
        micro_batch: The micro-batch per rank the run trains with now; None: the recipe's (also in checkpoints
            written before the micro-batch could grow).
        recipe_micro: The recipe's micro-batch (-b); None as `micro_batch`.
    """
    accum_steps: int
    recipe_accum: int
    history: List[RampChange] = field(default_factory=list)
    micro_batch: Optional[int] = None
    recipe_micro: Optional[int] = None

    def state_dict(self) -> Dict[str, Any]:
        # plain types only: checkpoints are loaded with weights_only=True
        return {'accum_steps': self.accum_steps, 'recipe_accum': self.recipe_accum,
                'history': [asdict(change) for change in self.history], 'micro_batch': self.micro_batch,
                'recipe_micro': self.recipe_micro}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.accum_steps = int(state['accum_steps'])
        self.recipe_accum = int(state['recipe_accum'])
        self.history = [RampChange(**change) for change in state.get('history', ())]
        self.micro_batch, self.recipe_micro = state.get('micro_batch'), state.get('recipe_micro')


def with_noise_scale(args: argparse.Namespace, world_size: int) -> Tuple[argparse.Namespace, Optional[str]]:
    """``--batch-ramp`` without ``--log-noise-scale``: a copy of `args` with the noise scale on, and the log line.

    The ramp follows B_simple, so asking for the ramp is asking for its measurement. On one process the estimate
    needs two batch sizes in every update: a run without accumulation keeps its global batch and splits it
    (`plan_accumulation`, at most half the micro-batch, a multiple of `batch_multiple`); when no exact split into
    2+ steps exists the accumulation becomes 2 and the global batch doubles (the LR follows by the run's rule).
    train.py and tune_batch.py both apply it before their checks, so the probe plans the run train.py trains.

    Returns:
        (`args`, None) when nothing changes, else (the copy, one line saying what was turned on and why).
    """
    if not args.batch_ramp or args.log_noise_scale:
        return args, None
    values: Dict[str, Any] = dict(log_noise_scale=True)
    line = '--batch-ramp follows the noise scale B_simple: --log-noise-scale turned on'
    if args.grad_accum_steps < min_accum_steps(True, world_size):
        micro, accum = args.batch_size, 2
        if args.batch_size >= 2:
            plan = plan_accumulation(args.batch_size, 1, args.batch_size // 2, batch_multiple(args))
            if plan.exact and plan.accum_steps >= 2:
                micro, accum = plan.micro_batch, plan.accum_steps
        values.update(batch_size=micro, grad_accum_steps=accum)
        grown = '' if micro * accum == args.batch_size else f" -> {micro * accum}; the LR follows by the run's rule"
        line += (f', with the two batch sizes per update it needs on one process: -b {args.batch_size} -> '
                 f'{micro} x {accum} accumulation (global batch {args.batch_size}{grown})')
    return with_values(args, **values), line + '.'


def ramp_cap(layout: BatchLayout, batches_per_epoch: int, num_epochs: int, min_updates: int,
             max_global: Optional[int] = None) -> int:
    """The largest accumulation a change from `layout` may reach (its own accumulation when none bigger may).

    A bigger accumulation must keep `min_updates` optimizer updates over a run of `num_epochs` at that batch (the
    guard tune_batch.py applies to a bigger global batch), keep the global batch within `max_global` when given,
    and at most double the accumulation (`MAX_GROWTH`).
    """
    unit = layout.micro_batch * layout.world_size
    cap = layout.accum_steps
    for accum in range(layout.accum_steps + 1, MAX_GROWTH * layout.accum_steps + 1):
        if max_global is not None and unit * accum > max_global:
            break
        if len(accumulation_windows(batches_per_epoch, accum)) * num_epochs < min_updates:
            break  # fewer updates per epoch at every larger accumulation too
        cap = accum
    return cap


def plan_ramp(b_simple: float, layout: BatchLayout, factor: float, cap: int) -> Optional[int]:
    """The accumulation to train the next epoch with, or None to keep `layout`'s.

    Args:
        b_simple: The B_simple EMA (samples); nan or non-positive when no estimate formed (keeps the layout).
        layout: The layout the last epoch trained with.
        factor: The global batch stays within ``b_simple / factor``.
        cap: The largest accumulation allowed (`ramp_cap`).
    """
    if not math.isfinite(b_simple) or b_simple <= 0:
        return None
    fits = math.floor(b_simple / (factor * layout.micro_batch * layout.world_size))
    accum = min(fits, cap)
    return accum if accum > layout.accum_steps else None


def split_global(target_global: int, layout: BatchLayout, max_micro: Optional[int],
                 multiple: int = 1) -> Tuple[int, int]:
    """(micro-batch, accumulation) for a global batch the ramp grew to: the biggest micro-batch first.

    A bigger micro-batch is faster per sample on a GPU; more accumulation only saves optimizer steps. The split is
    exact (the global batch is the rule's, so the LR moves by the rule), the micro-batch never shrinks below
    `layout`'s nor passes `max_micro`, stays a multiple of `multiple` (2 under mixup), and the accumulation keeps
    what the noise-scale estimate needs (`min_accum_steps`), else the ramp would stop measuring.

    Args:
        target_global: The new global batch, a multiple of ``layout.micro_batch x layout.world_size``.
        layout: The layout the last epoch trained with.
        max_micro: The largest micro-batch per rank allowed (--batch-ramp-max-micro), None: keep `layout`'s.
        multiple: What every micro-batch must be a multiple of (`timm_ext.train.setup.batch_multiple`).
    """
    world_size, micro = layout.world_size, layout.micro_batch
    limit = min(max_micro or 0, target_global // (world_size * min_accum_steps(True, world_size)))
    if limit > micro:
        plan = plan_accumulation(target_global, world_size, limit, multiple)
        if plan.exact and plan.micro_batch > micro:
            return plan.micro_batch, plan.accum_steps
        # plan_accumulation looks only at micro-batches of at least half the limit; any exact bigger one still helps
        for bigger in range(limit - limit % multiple, micro, -multiple):
            if target_global % (bigger * world_size) == 0:
                return bigger, target_global // (bigger * world_size)
    return micro, target_global // (micro * world_size)


def lr_factor(old_global: int, new_global: int, scale: str) -> float:
    """What the LR is multiplied by when the global batch moves from `old_global` to `new_global` ('linear'/'sqrt')."""
    return rescale_lr(1.0, old_global, new_global, scale)


def describe_ramp_change(change: RampChange, factor: float, scale: str, lr_before: float, lr_after: float,
                         updates_before: int, updates_after: int) -> str:
    """The one log line of a change."""
    micro = (f'micro-batch {change.old_micro} -> {change.new_micro}, ' if change.new_micro != change.old_micro
             else '')
    return (f'Batch ramp before epoch {change.epoch}: B_simple ≈ {change.b_simple:.1f} samples allows a global batch '
            f'up to B_simple / {factor:g} = {change.b_simple / factor:.0f}: {micro}accumulation {change.old_accum} -> '
            f'{change.new_accum} '
            f'(global batch {change.old_global} -> {change.new_global}, {updates_before} -> {updates_after} updates '
            f'per epoch), LR x{change.lr_factor:.4g} by the {scale} rule ({lr_before:.4g} -> {lr_after:.4g}).')


class RecipeClock:
    """A per-update timm scheduler driven in the recipe's updates while the accumulation changes.

    The loop counts updates of its current layout (``epoch x updates_per_epoch + update``); every epoch trains the
    same samples, so that count times ``recipe_updates_per_epoch / updates_per_epoch`` is the recipe's updates for
    the same samples: exact at every epoch boundary, in proportion inside an epoch (rounded to a whole update).
    Everything but `step_update` goes to the scheduler.

    Args:
        scheduler: The timm scheduler, built with the recipe's updates per epoch.
        recipe_updates_per_epoch: Its updates per epoch.
    """

    def __init__(self, scheduler: Any, recipe_updates_per_epoch: int):
        self.scheduler = scheduler
        self.recipe_updates_per_epoch = recipe_updates_per_epoch
        self.updates_per_epoch = recipe_updates_per_epoch  # of the layout the loop trains now
        self.last_update: Optional[int] = None  # the recipe update the schedule was last set for

    def step_update(self, num_updates: int, metric: Optional[float] = None) -> None:
        # an integer: timm seeds --lr-noise with the step
        self.last_update = round(num_updates * self.recipe_updates_per_epoch / self.updates_per_epoch)
        self.scheduler.step_update(self.last_update, metric)

    def __getattr__(self, name: str) -> Any:
        scheduler = self.__dict__.get('scheduler')  # absent while copy or pickle rebuild the object
        if scheduler is None:
            raise AttributeError(name)
        return getattr(scheduler, name)


class TrainLoaderRebuild:
    """Rebuilds a run's training loader at another micro-batch, with the training stack's own builder.

    Everything but the batch size stays the run's (augmentation, mixup in the collate, prefetcher, sampler,
    workers); the loop keeps its own mixup_fn (the same settings). The new loader replaces
    ``stack.data.loader_train`` and its micro-batch ``stack.data.reference_batch``, the loss weights' reference;
    the run sets its epoch before iterating it, as for the first.

    Args:
        args: The run's arguments (copied with the new -b, never changed).
        stack: The run's training stack (`timm_ext.train.stack.TrainingStack`).
        device: The training device.
    """

    def __init__(self, args: Any, stack: Any, device: torch.device):
        self.args = args
        self.stack = stack
        self.device = device

    @property
    def batches_per_epoch(self) -> int:
        """Loader batches per epoch of the loader the run trains with now."""
        return len(self.stack.data.loader_train)

    def __call__(self, micro_batch: int) -> int:
        """Build the loader at `micro_batch` per rank and hand it to the run; returns its batches per epoch."""
        stack = self.stack
        loader, _, _ = build_train_loader(with_values(self.args, batch_size=micro_batch), stack.data.dataset_train,
                                          stack.data_config, self.device, stack.model_dtype, stack.model)
        stack.data.loader_train, stack.data.reference_batch = loader, float(micro_batch)
        return len(loader)


def _mean_lr(optimizer: torch.optim.Optimizer) -> float:
    return sum(group['lr'] for group in optimizer.param_groups) / len(optimizer.param_groups)


class BatchRamp:
    """Applies the ramp to a run: the loop's layout, the training loader, the optimizer's LRs and the scheduler.

    Args:
        optimizer: The run's optimizer.
        scheduler: The timm scheduler as built for the recipe (None without one); a per-update one is wrapped in
            `RecipeClock` (`scheduler` is what the loop and the resume must step).
        recipe: The recipe's layout (-b, ranks, --grad-accum-steps).
        batches_per_epoch: Loader batches (micro-batches) per epoch on each rank, at the recipe's micro-batch.
        num_epochs: Epochs of the run.
        factor: The global batch stays within B_simple / factor.
        min_updates: Updates a run at a bigger batch must keep (`ramp_cap`).
        max_global: The largest global batch, or None.
        scale: The run's LR rule, 'linear' or 'sqrt'.
        verbose: Log the changes (rank 0).
        max_micro: The largest micro-batch per rank the ramp may grow to (--batch-ramp-max-micro), None: the
            recipe's stays.
        multiple: What every micro-batch must be a multiple of (2 under mixup).
        reload: Rebuilds the training loader at a micro-batch and returns its batches per epoch
            (`TrainLoaderRebuild`); needed with `max_micro`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any, recipe: BatchLayout, batches_per_epoch: int,
                 num_epochs: int, factor: float = RAMP_FACTOR, min_updates: int = 0,
                 max_global: Optional[int] = None, scale: str = 'linear', verbose: bool = True,
                 max_micro: Optional[int] = None, multiple: int = 1,
                 reload: Optional[Callable[[int], int]] = None):
        if max_micro is not None and reload is None:
            raise ValueError('a ramp that may grow the micro-batch needs reload, to rebuild the loader')
        self.optimizer = optimizer
        self.inner = scheduler
        self.recipe = recipe
        self.batches_per_epoch = batches_per_epoch  # of the loader the run trains with now
        self.loader_micro = recipe.micro_batch  # the micro-batch that loader was built for
        self.num_epochs = num_epochs
        self.factor = factor
        self.min_updates = min_updates
        self.max_global = max_global
        self.scale = scale
        self.verbose = verbose
        self.max_micro = max_micro
        self.multiple = multiple
        self.reload = reload
        self.state = RampState(recipe.accum_steps, recipe.accum_steps, [], recipe.micro_batch, recipe.micro_batch)
        self.scheduler = scheduler
        if scheduler is not None and not scheduler.t_in_epochs:
            self.scheduler = RecipeClock(scheduler, self.updates_per_epoch)
        self._capped_logged = False

    @classmethod
    def for_run(cls, args: Any, optimizer: torch.optim.Optimizer, scheduler: Any, loader: TrainLoaderRebuild,
                num_epochs: int, min_updates: int, saved: Optional[Dict[str, Any]] = None,
                verbose: bool = True) -> 'BatchRamp':
        """The ramp of a train.py run from its arguments, continuing a resumed checkpoint's ramp.

        Args:
            args: train.py's arguments (the layout as the run trains it, after any elastic re-plan).
            optimizer: The optimizer (a resumed one carries the checkpoint's ramped LR).
            scheduler: The timm scheduler as built, or None.
            loader: Rebuilds the run's training loader (which is at the recipe's micro-batch now).
            num_epochs: Epochs of the run.
            min_updates: The update guard when --batch-ramp-min-updates is unset.
            saved: The resumed checkpoint's ramp state (`timm_ext.train.checkpoint.saved_ramp_state`), or None. A
                saved ramp at another micro-batch than -b rebuilds the loader at it now.
            verbose: Log (rank 0).
        """
        recipe = BatchLayout(args.batch_size, args.world_size, args.grad_accum_steps)
        factor = args.batch_ramp_factor or RAMP_FACTOR
        ramp = cls(optimizer, scheduler, recipe, loader.batches_per_epoch, num_epochs, factor,
                   args.batch_ramp_min_updates or min_updates, args.batch_ramp_max,
                   args.lr_base_scale or default_lr_scale(args.opt), verbose, args.batch_ramp_max_micro,
                   batch_multiple(args), loader)
        if saved:
            ramp.restore(saved, fresh_optimizer=args.no_resume_opt)
        return ramp

    @property
    def layout(self) -> BatchLayout:
        return replace(self.recipe, micro_batch=self.state.micro_batch or self.recipe.micro_batch,
                       accum_steps=self.state.accum_steps)

    @property
    def updates_per_epoch(self) -> int:
        return len(accumulation_windows(self.batches_per_epoch, self.state.accum_steps))

    def state_dict(self) -> Dict[str, Any]:
        return self.state.state_dict()

    def restore(self, state: Dict[str, Any], fresh_optimizer: bool = False) -> None:
        """Continue a checkpoint's ramp (before the scheduler is positioned: it must count in the ramp's updates).

        The same recipe continues at the checkpoint's layout, its micro-batch included (the loader is rebuilt at
        it). A resume on another layout (an elastic re-plan) keeps the ramp's growth of the global batch over the
        recipe, split again by `split_global`. The optimizer's state carries the ramped LR; a fresh one
        (`fresh_optimizer`, --no-resume-opt) gets it by the rule.
        """
        saved = RampState(1, 1)
        saved.load_state_dict(state)
        recipe = self.recipe
        saved_recipe_micro = saved.recipe_micro or recipe.micro_batch
        micro, accum = saved.micro_batch or saved_recipe_micro, saved.accum_steps
        if (saved_recipe_micro, saved.recipe_accum) != (recipe.micro_batch, recipe.accum_steps):
            growth = micro * accum / (saved_recipe_micro * saved.recipe_accum)
            accum = max(recipe.accum_steps, round(growth * recipe.accum_steps))
            micro, accum = split_global(recipe.micro_batch * recipe.world_size * accum, recipe, self.max_micro,
                                        self.multiple)
        self.state = RampState(accum, recipe.accum_steps, saved.history, micro, recipe.micro_batch)
        self._sync_loader()
        self._sync_clock()
        if fresh_optimizer and self.layout.global_batch != recipe.global_batch:
            self._scale_lr(lr_factor(recipe.global_batch, self.layout.global_batch, self.scale))
        if self.verbose:
            _logger.info(f'Batch ramp: continuing the checkpoint\'s {self.layout.describe()} ({len(saved.history)} '
                         f'change(s) so far; the recipe is {recipe.describe()}).')

    def before_epoch(self, epoch: int, loop: Any, decide: bool = True) -> bool:
        """Re-plan from the B_simple so far and set the loop's layout; True when the global batch grew.

        Called at the start of every epoch on every rank (the estimate is averaged over ranks, a collective, so
        all ranks take the same decision). `decide` is False when resuming inside an epoch: its change was made
        before the checkpoint was written.
        """
        changed = False
        if decide:
            summary = loop.noise_scale_summary()
            changed = summary is not None and self._grow(epoch, summary.b_simple)
        loop.set_layout(self.layout.micro_batch, self.state.accum_steps)
        return changed

    def _grow(self, epoch: int, b_simple: float) -> bool:
        layout = self.layout
        cap = ramp_cap(layout, self.batches_per_epoch, self.num_epochs, self.min_updates, self.max_global)
        accum = plan_ramp(b_simple, layout, self.factor, cap)
        if accum is None:
            if self.verbose and not self._capped_logged and plan_ramp(b_simple, layout, self.factor, 2 * cap):
                self._capped_logged = True
                _logger.info(f'Batch ramp before epoch {epoch}: B_simple ≈ {b_simple:.1f} samples would allow a '
                             f'bigger batch, but {layout.describe()} is the cap (at least {self.min_updates} '
                             f'updates over {self.num_epochs} epochs, largest global batch {self.max_global}).')
            return False
        # never a micro-batch past the samples a rank trains per epoch: the new loader would have no batch
        max_micro = self.max_micro and min(self.max_micro, self.batches_per_epoch * self.loader_micro)
        micro, accum = split_global(layout.micro_batch * layout.world_size * accum, layout, max_micro, self.multiple)
        new = replace(layout, micro_batch=micro, accum_steps=accum)
        change = RampChange(epoch, b_simple, layout.accum_steps, accum, layout.global_batch, new.global_batch,
                            lr_factor(layout.global_batch, new.global_batch, self.scale), layout.micro_batch, micro)
        lr_before, updates_before = _mean_lr(self.optimizer), self.updates_per_epoch
        self.state.accum_steps, self.state.micro_batch = accum, micro
        self.state.history.append(change)
        self._sync_loader()
        self._sync_clock()
        self._scale_lr(change.lr_factor, epoch)
        if self.verbose:
            _logger.info(describe_ramp_change(change, self.factor, self.scale, lr_before, _mean_lr(self.optimizer),
                                              updates_before, self.updates_per_epoch))
        return True

    def _sync_loader(self) -> None:
        """Rebuild the training loader when the ramp's micro-batch is not the one it was built for."""
        micro = self.layout.micro_batch
        if micro != self.loader_micro:
            self.batches_per_epoch, self.loader_micro = self.reload(micro), micro

    def _sync_clock(self) -> None:
        if isinstance(self.scheduler, RecipeClock):
            self.scheduler.updates_per_epoch = self.updates_per_epoch

    def _scale_lr(self, factor: float, epoch: Optional[int] = None) -> None:
        """Multiply the LR: the optimizer's groups, the scheduler's bases (and warm-up slopes), then, at `epoch`,
        set the LR the rescaled schedule gives where it stands."""
        scale_group_lrs(self.optimizer, factor)
        inner = self.inner
        if inner is None:
            return
        old = list(inner.base_values)
        inner.base_values = [v * factor for v in old]
        warmup_t = getattr(inner, 'warmup_t', 0)
        if warmup_t and hasattr(inner, 'warmup_steps'):  # the warm-up still ends at its (now scaled) base
            inner.warmup_steps = [s + (v * factor - v) / warmup_t for s, v in zip(inner.warmup_steps, old)]
        from timm.scheduler import PlateauLRScheduler
        if epoch is None or isinstance(inner, PlateauLRScheduler):
            return  # a plateau schedule keeps its LR in the groups, scaled above
        if inner.t_in_epochs:
            inner.step(epoch)
        elif self.scheduler.last_update is not None:
            inner.step_update(self.scheduler.last_update)
