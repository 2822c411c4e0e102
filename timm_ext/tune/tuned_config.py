"""The tuned run's handover to training: the YAML config train.py reads with `-c`, and the command that trains from it.

The config holds only stock train.py keys (`config_values`), so stock timm reads it too; our extension flags go onto
the command line (`extension_flags`, `train_command`), and the report into the config's comment header
(`tuned_config_text`), ending in the train command (`TRAIN_WITH`, read back by `planned_command`). `tuned_config`
puts these together for a plan, and `write_tuned_config` writes the config and prints how to train from it: the one
way both of tune_batch.py's paths, the probe and `--estimate`, hand over.
"""
import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import yaml

from ..atomic_files import atomic_text
from ..launch import Topology
from ..train.args import EXTENSIONS_GROUP, build_parser, config_keys, group_dests
from .plan import RunPlan

__all__ = [
    'TunedConfig', 'tuned_config', 'write_tuned_config', 'config_values', 'tuned_config_text', 'extension_flags',
    'train_command', 'shell_line', 'TRAIN_WITH', 'planned_command',
]


@dataclass(frozen=True)
class TunedConfig:
    """A tuned run as training will read it.

    Attributes:
        path: Where the YAML config goes.
        values: Its keys (stock train.py's only) and values.
        flags: Our extension flags, which go on the command line only.
        command: The train command (`train_command`), the flags on it.
    """
    path: str
    values: Dict[str, Any]
    flags: List[str]
    command: List[str]

    @property
    def command_line(self) -> str:
        """The train command as one shell line."""
        return shell_line(self.command)


def tuned_config(args: argparse.Namespace, parser: argparse.ArgumentParser, plan: RunPlan, path: str,
                 script_dir: str, world_size: int, topology: Optional[Topology] = None,
                 values: Optional[Dict[str, Any]] = None, flags: Sequence[str] = ()) -> TunedConfig:
    """The config and the train command of `plan` for the run `args` describes.

    Args:
        args: The train arguments as parsed (what the config describes, not a copy with runtime fields).
        parser: tune_batch.py's parser: train.py's flags, whose defaults are what the config leaves out, and ours.
        plan: The run plan (micro-batch, accumulation, LR).
        path: Where the config goes.
        script_dir: The folder of train.py and distributed_train.sh.
        world_size: Ranks training runs on.
        topology: The multi-node torchrun launch training must repeat (None: one node).
        values: Stock keys the tuner settled besides the plan (a lengthened schedule, `validation_batch_size`, ...).
        flags: Extension flags the tuner settled besides the parsed ones (`--batch-ramp-max-micro`).
    """
    extension_dests = group_dests(parser, EXTENSIONS_GROUP)
    stock_dests = sorted(config_keys(build_parser()) - set(extension_dests))  # train.py's keys, ours left out
    extras = [*extension_flags(args, parser, extension_dests), *flags]
    command = train_command(sys.executable, script_dir, path, world_size, extras, topology)
    return TunedConfig(path, {**config_values(args, parser, stock_dests, plan), **(values or {})}, extras, command)


def write_tuned_config(config: TunedConfig, report: Sequence[str], notes: Sequence[str] = (),
                       summary: Sequence[str] = (), shown: Optional[Sequence[str]] = None) -> None:
    """Print the report, write the config (crash-safe, its header the report and the train command), then print
    `notes` and the closing block: `summary`, where the config is and the command that trains from it. `shown`: the
    report as the terminal shows it, when that leaves out what it printed already (`timm_ext.tune.tuner.shown_report`).
    """
    print('\n'.join(report if shown is None else shown))
    os.makedirs(os.path.dirname(os.path.abspath(config.path)), exist_ok=True)
    atomic_text(tuned_config_text(config.values, [*report, '', TRAIN_WITH + config.command_line]), config.path)
    closing = ['', *summary, f'Config: {config.path}', f'Train command: {config.command_line}']
    print('\n'.join([*notes, *closing]), flush=True)


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
