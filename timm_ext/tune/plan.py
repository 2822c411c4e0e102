"""From a probed micro-batch to a run: accumulation, learning rate, the YAML config and the train command.

`plan_run` decides micro-batch x world size x accumulation and the LR the run will use, through the same functions
train.py uses (`timm_ext.accum.plan_accumulation`, `timm_ext.lr.resolve_lr` / `rescale_lr`). `tuned_config_text`
writes a config `train.py -c` reads: only stock train.py keys, so stock timm reads it too; our extension flags and
the probe's findings go into a comment header, and extension flags onto the command line (`train_command`).
"""
import argparse
import dataclasses
import shlex
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import yaml

from ..accum import plan_accumulation
from ..launch import Topology
from ..lr import default_lr_scale, rescale_lr, resolve_lr
from ..train.noise_monitor import min_accum_steps
from ..train.setup import batch_multiple

__all__ = [
    'RunPlan', 'plan_run', 'plan_global_batch', 'config_values', 'tuned_config_text', 'extension_flags',
    'train_command', 'shell_line', 'TRAIN_WITH', 'planned_command',
]


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


def config_values(args: argparse.Namespace, parser: argparse.ArgumentParser, keys: Sequence[str],
                  plan: RunPlan) -> Dict[str, Any]:
    """The values of `keys` that differ from `parser`'s defaults, with the plan's batch, accumulation and LR.

    Args:
        args: The resolved train arguments.
        parser: The train parser (its defaults are what a config may leave out).
        keys: Dest names to consider (e.g. only stock train.py keys).
        plan: The run plan.
    """
    values = {}
    for key in keys:
        value = getattr(args, key)
        if value != parser.get_default(key):
            values[key] = list(value) if isinstance(value, tuple) else value
    values['batch_size'] = plan.micro_batch
    values['grad_accum_steps'] = plan.accum_steps
    if plan.lr_to_write is not None:
        values['lr'] = plan.lr_to_write
    elif 'lr' in values:
        del values['lr']
    return values


def tuned_config_text(values: Dict[str, Any], header: Sequence[str]) -> str:
    """The YAML text: comment lines of `header` (the probe's report, extension settings), then the values."""
    lines = [line for entry in header for line in entry.split('\n')]  # an entry may be a table of several lines
    comments = ''.join(f'# {line}\n' if line else '#\n' for line in lines)
    return comments + yaml.safe_dump(values, default_flow_style=False, sort_keys=True)


def extension_flags(args: argparse.Namespace, parser: argparse.ArgumentParser, dests: Sequence[str]) -> List[str]:
    """Command-line flags reproducing the non-default values of `dests` (our train.py's extension flags)."""
    actions = {a.dest: a for a in parser._actions}
    flags: List[str] = []
    for dest in dests:
        value, action = getattr(args, dest), actions[dest]
        if value == action.default:
            continue
        option = action.option_strings[-1]
        if action.nargs == 0:
            flags.append(option)
        elif isinstance(value, (list, tuple)):
            flags += [option, *map(str, value)]
        else:
            flags += [option, str(value)]
    return flags


def train_command(python: str, script_dir: str, config_path: str, nproc: int, extra: Sequence[str],
                  topology: Optional[Topology] = None) -> List[str]:
    """The train command: `python train.py -c CONFIG ...`, `distributed_train.sh N -c CONFIG ...` on one node, or
    torchrun with the options of a multi-node `topology` (the one tune_batch.py was started under)."""
    if topology is not None and topology.multi_node:
        return [python, '-m', 'torch.distributed.run', *topology.torchrun_options(), f'{script_dir}/train.py',
                '-c', config_path, *extra]
    if nproc > 1:
        return [f'{script_dir}/distributed_train.sh', str(nproc), '-c', config_path, *extra]
    return [python, f'{script_dir}/train.py', '-c', config_path, *extra]


def shell_line(command: Sequence[str]) -> str:
    return shlex.join(command)


TRAIN_WITH = 'Train with: '  # the tuned config's header line that records the train command


def planned_command(config_text: str) -> Optional[List[str]]:
    """The train command a tuned config's header records (`tuned_config_text` with a `TRAIN_WITH` line), or None.

    tune_batch.py --nproc N reads it back once its probe ranks have exited: flags they added from what they measured
    (--batch-ramp-max-micro) are on it, and on nothing the parent process parsed.
    """
    for line in config_text.splitlines():
        if line.startswith(f'# {TRAIN_WITH}'):
            return shlex.split(line[len(f'# {TRAIN_WITH}'):])
    return None
