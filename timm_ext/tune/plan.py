"""From a probed micro-batch to a run: accumulation and the learning rate.

`plan_run` decides micro-batch x world size x accumulation and the LR the run will use, through the same functions
train.py uses (`timm_ext.accum.plan_accumulation`, `timm_ext.lr.resolve_lr` / `rescale_lr`). The config and the
command that train from a plan are `timm_ext.tune.tuned_config`'s.
"""
import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..accum import plan_accumulation
from ..lr import default_lr_scale, rescale_lr, resolve_lr
from ..train.noise_monitor import min_accum_steps
from ..train.setup import batch_multiple

__all__ = ['RunPlan', 'plan_run', 'plan_global_batch']


@dataclass(frozen=True)
class RunPlan:
    """How the tuned run trains.

    Attributes:
        micro_batch: -b/--batch-size per rank.
        accum_steps: --grad-accum-steps.
        world_size: Ranks.
        global_batch: micro_batch x world_size x accum_steps.
        target_global: The global batch asked for (--target-global-batch), or None.
        exact: Whether `global_batch == target_global` (None without a target).
        lr: The LR the run will use.
        lr_to_write: The --lr to put into the config, or None to let train.py compute it from --lr-base.
        lr_rule: 'linear' / 'sqrt' when scaled, '' when --lr was given and kept.
        reason: Why this accumulation (one sentence).
        lr_reason: How the LR was reached (one sentence).
    """
    micro_batch: int
    accum_steps: int
    world_size: int
    global_batch: int
    target_global: Optional[int]
    exact: Optional[bool]
    lr: float
    lr_to_write: Optional[float]
    lr_rule: str
    reason: str
    lr_reason: str

    def split_line(self) -> str:
        """The split and why, each said once: 'global batch 96 = 16 x 1 x 6, exactly (...)'."""
        return (f'global batch {self.global_batch} = {self.micro_batch} x {self.world_size} x {self.accum_steps}, '
                f'{self.reason}')


def plan_run(args: argparse.Namespace, max_micro_batch: int, world_size: int,
             target_global: Optional[int] = None) -> RunPlan:
    """Plan accumulation and LR for a run whose largest usable micro-batch is `max_micro_batch`.

    `max_micro_batch` is the probe's selection: the largest batch that fits, or the throughput choice.

    Without a target the run keeps its --grad-accum-steps. With one, the largest micro-batch <= `max_micro_batch`
    that splits the target exactly is used; if none does, the nearest global batch, and the LR moves with it:
    an explicit --lr (set for the target) is rescaled by the run's rule; an LR from --lr-base follows the actual
    global batch by train.py's own rule.
    """
    scale = args.lr_base_scale or default_lr_scale(args.opt)
    multiple = batch_multiple(args)
    if target_global is not None:
        min_steps = min_accum_steps(args.log_noise_scale, world_size)
        max_micro_batch = min(max_micro_batch, max(multiple, target_global // (world_size * min_steps)))
        accum = plan_accumulation(target_global, world_size, max_micro_batch, multiple)
        micro, steps, exact, reason = accum.micro_batch, accum.accum_steps, accum.exact, accum.reason
        if min_steps > 1:
            reason += f' (--log-noise-scale on one process needs {min_steps}+ accumulation steps)'
    else:
        micro, steps, exact = max(multiple, max_micro_batch - max_micro_batch % multiple), args.grad_accum_steps, None
        reason = f'no --target-global-batch: the selected micro-batch, with --grad-accum-steps {steps} as given'
        if micro != max_micro_batch:
            reason += f' (mixup/cutmix need an even batch: {micro}, not {max_micro_batch})'
    global_batch = micro * world_size * steps
    if args.lr:
        if target_global is not None and not exact:
            lr = rescale_lr(args.lr, target_global, global_batch, scale)
            lr_reason = (f'--lr {args.lr:g} was set for global batch {target_global}; rescaled by the {scale} rule to '
                         f'{lr:g} for global batch {global_batch}')
            return RunPlan(micro, steps, world_size, global_batch, target_global, exact, lr, lr, scale, reason,
                           lr_reason)
        why = 'the global batch is the one asked for' if exact else 'as given'
        return RunPlan(micro, steps, world_size, global_batch, target_global, exact, args.lr, args.lr, '', reason,
                       f'--lr {args.lr:g} kept ({why})')
    choice = resolve_lr(None, args.lr_base, args.lr_base_size, args.lr_base_scale, args.opt, micro, world_size, steps)
    lr_reason = choice.message
    if target_global is not None and not exact:
        lr_reason += f' (global batch {global_batch} instead of {target_global}: the rule follows the real one)'
    if choice.hint:
        lr_reason += ' ' + choice.hint
    return RunPlan(micro, steps, world_size, global_batch, target_global, exact, choice.lr, None, choice.scale,
                   reason, lr_reason)


def plan_global_batch(args: argparse.Namespace, micro_batch: int, accum_steps: int, world_size: int,
                      recipe_global: int) -> RunPlan:
    """The plan for a global batch chosen instead of the recipe's (`timm_ext.tune.batch_choice`), with its LR: from
    --lr-base by train.py's rule, or an explicit --lr moved from the recipe's global batch by the run's rule."""
    global_batch = micro_batch * world_size * accum_steps
    plan = plan_run(args, micro_batch, world_size, global_batch)
    if args.lr and global_batch != recipe_global:
        scale = args.lr_base_scale or default_lr_scale(args.opt)
        lr = rescale_lr(args.lr, recipe_global, global_batch, scale)
        plan = dataclasses.replace(plan, lr=lr, lr_to_write=lr, lr_rule=scale, lr_reason=(
            f'--lr {args.lr:g} was set for the recipe\'s global batch {recipe_global}; rescaled by the {scale} rule '
            f'to {lr:g} for global batch {global_batch}'))
    return plan
