"""The stock flag spec kept as test data (tests/data/timm_*_args.json) and its comparison with our parsers.

The spec lists every argument of timm's stock train.py / validate.py (flags, dest, default, type, nargs, choices,
const, action class, group, mutual exclusion): interface facts our drop-in scripts must keep.
"""
import argparse
import json
from pathlib import Path
from typing import Dict, List, Optional

SPEC_DIR = Path(__file__).resolve().parent / 'data'


def load_spec(script: str) -> List[dict]:
    """The stock spec of `script` ('train' or 'validate')."""
    return json.loads((SPEC_DIR / f'timm_{script}_args.json').read_text())


def group_title(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The argument group `action` is listed under, with the spec's name for the general group."""
    if action in parser._optionals._group_actions:
        return 'options'  # argparse's title for it is 'optional arguments' before Python 3.10
    for group in parser._action_groups:
        if action in group._group_actions:
            return group.title
    raise AssertionError(f'{action.dest} is in no argument group')


def describe(parser: argparse.ArgumentParser, action: argparse.Action) -> dict:
    """The spec's fields for one of our actions."""
    return {
        'flags': list(action.option_strings) or [action.dest],
        'dest': action.dest,
        'default': action.default,
        'type': getattr(action.type, '__name__', None),
        'nargs': action.nargs,
        'choices': list(action.choices) if action.choices is not None else None,
        'const': action.const,
        'action': type(action).__name__,
        'group': group_title(parser, action),
        'mutually_exclusive': any(action in g._group_actions for g in parser._mutually_exclusive_groups),
    }


def spec_mismatches(spec: List[dict], parsers: Dict[str, argparse.ArgumentParser],
                    ignore_fields: Optional[set] = None) -> List[str]:
    """Every difference between the spec and our parsers, one line each (empty: full parity).

    Args:
        spec: Entries of `load_spec`.
        parsers: Our parser for each value of the entries' 'parser' field ('parser', 'config_parser').
        ignore_fields: Spec fields not compared (besides 'parser').
    """
    skip = {'parser'} | (ignore_fields or set())
    actions = {name: {a.dest: a for a in p._actions} for name, p in parsers.items()}
    mismatches = []
    for entry in spec:
        parser = parsers[entry['parser']]
        action = actions[entry['parser']].get(entry['dest'])
        if action is None:
            mismatches.append(f"{entry['dest']}: missing")
            continue
        ours = describe(parser, action)
        for field, want in entry.items():
            if field in skip:
                continue
            got = ours[field]
            if got != want or type(got) is not type(want):
                mismatches.append(f"{entry['dest']}.{field}: stock {want!r}, ours {got!r}")
    return mismatches


def default_differences(spec: List[dict], values: dict, given: set) -> List[str]:
    """Stock defaults that a run's resolved arguments (e.g. its args.yaml) do not hold, one line each.

    Args:
        spec: Entries of `load_spec`.
        values: Resolved arguments by dest.
        given: Dests the run set on purpose (its command line), not compared.
    """
    skip = {'config'} | given
    differences = []
    for entry in spec:
        dest = entry['dest']
        if dest in skip:
            continue
        if dest not in values:
            differences.append(f'{dest}: missing')
            continue
        want, got = entry['default'], values[dest]
        if isinstance(want, (list, tuple)) or isinstance(got, (list, tuple)):
            want, got = list(want or []), list(got or [])
        if want != got:
            differences.append(f"{dest}: stock default {entry['default']!r}, here {values[dest]!r}")
    return differences


def read_like_stock(spec: List[dict], config_text: str) -> argparse.Namespace:
    """A YAML config read as stock train.py reads it: a parser of the spec's flags, the config's keys set as its
    defaults (`parser.set_defaults(**yaml.safe_load(...))`), an empty command line parsed."""
    import yaml
    types = {'int': int, 'float': float, 'str': str, None: None}
    parser = argparse.ArgumentParser()
    for entry in spec:
        if entry['parser'] != 'parser':
            continue
        positional = not entry['flags'][0].startswith('-')  # its name is its dest
        where = {} if positional else dict(dest=entry['dest'])
        if entry['action'] == '_StoreTrueAction':
            parser.add_argument(*entry['flags'], **where, action='store_true', default=entry['default'])
        else:  # a store (ParseKwargs only differs on the command line, which is empty here)
            parser.add_argument(*entry['flags'], **where, default=entry['default'], nargs=entry['nargs'],
                                type=types[entry['type']], choices=entry['choices'])
    parser.set_defaults(**yaml.safe_load(config_text))
    return parser.parse_args([])
