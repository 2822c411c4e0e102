"""The whole zoo: one model of every timm family traced on the CUDA estimate path, forward only and training.

    python bench/bench_zoo.py                                   # every family, both modes, into docs/zoo.csv
    python bench/bench_zoo.py --families resnet,cait --modes validate
    python bench/bench_zoo.py --limit 10 --batches 2,4 --timeout 300
    python bench/bench_zoo.py --shard 1/2 --output /tmp/zoo.1.csv   # every other family, from the second
    python bench/bench_zoo.py --report                          # the counts of the CSV as it stands
    python bench/bench_zoo.py --torchcompile                    # compiled (inductor), into docs/zoo-compiled.csv

A family is a module of `timm.models` (the module of the model's entry point). Its model is the smallest by name:
the size words timm's families use (atto < femto < pico < nano < ... < small < base), then its default input's
pixels, then the largest number in the name (depth, width or input size), then the name; timm's own `test_*` models
are left out (they are no model a user runs). Each model is traced at its default input size on the path
`tune_batch.py --estimate --device cuda --amp` takes (`timm_ext.memory_model.estimate.estimate_memory(args, 'cuda',
...)`): step 'validate' (validate.py's forward with the weights alone) and step 'train' (train.py's update; an
encoder without a head, num_classes 0, with `--num-classes 1000`). Each trace runs in a process of its own under
`--timeout`; the CSV gets one row per family and mode: ok, the error's class and one-line message, or timeout. Rows
already in the CSV are skipped, so a stopped run resumes where it left off (`--fresh` starts over).

`--torchcompile [BACKEND]` traces the same models as `tune_batch.py --estimate --torchcompile` plans them (train.py's
flag, inductor by default: `timm_ext.memory_model.compiled_step`), into a CSV of its own; the report gives the share
of families that trace compiled in every mode asked.
"""
import argparse
import csv
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OUTPUT = os.path.join(ROOT, 'docs', 'zoo.csv')
COMPILED_OUTPUT = os.path.join(ROOT, 'docs', 'zoo-compiled.csv')
FIELDS = ('family', 'model', 'mode', 'status', 'error', 'message', 'seconds')
MODES = ('validate', 'train')
# size words of timm's model names, smallest first (a name without one ranks after them all)
SIZE_WORDS = ('atto', 'zepto', 'femto', 'pico', 'nano', 'xxs', 'xxsmall', 'micro', 'mini', 'xs', 'xsmall', 'xtiny',
              'tiny', 'lite', 't', 's', 'small')
NUMBER = re.compile(r'\d+')
DEFAULT_SIZE = (224, 224)  # timm's input size where a model has no pretrained config


def size_key(name: str) -> Tuple[int, int, int, str]:
    """How small a model is by its name and default input: its smallest size word, its input's pixels, its largest
    number, then the name."""
    from timm.models import get_pretrained_cfg
    words = re.split(r'[_\W]+', name)
    rank = min((SIZE_WORDS.index(w) for w in words if w in SIZE_WORDS), default=len(SIZE_WORDS))
    config = get_pretrained_cfg(name)
    height, width = (config.input_size[-2:] if config is not None else DEFAULT_SIZE)
    numbers = [int(n) for n in NUMBER.findall(name)]  # depth, width or input size: the largest says most
    return rank, height * width, max(numbers, default=0), name


def families() -> Dict[str, str]:
    """Family (the module's last name) -> its smallest model by name, every family of `timm.list_models()`."""
    import timm
    from timm.models._registry import model_entrypoint
    members = defaultdict(list)
    for name in timm.list_models():
        if not name.startswith('test_'):
            members[model_entrypoint(name).__module__.rsplit('.', 1)[-1]].append(name)
    return {family: min(names, key=size_key) for family, names in sorted(members.items())}


def trace_one(model: str, mode: str, batches: Sequence[int], torchcompile: str = '') -> dict:
    """One model's estimate as `tune_batch.py --estimate --device cuda --amp [--torchcompile BACKEND]` runs it: ok,
    or the error's class and its message on one line."""
    from timm.models import get_pretrained_cfg
    from timm_ext.memory_model.estimate import estimate_memory
    from timm_ext.train.args import parse_args
    # an encoder without a head (num_classes 0) trains with one, as train.py on ImageNet-1k gives it
    head = ['--num-classes', '1000'] if mode == 'train' and get_pretrained_cfg(model).num_classes == 0 else []
    compiled = ['--torchcompile', torchcompile] if torchcompile else []
    try:
        args, _ = parse_args(['--model', model, '--device', 'cuda', '--amp', *head, *compiled])
        args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
        estimate_memory(args, 'cuda', batches=batches, step_kind=mode)
    except Exception as e:  # the bench records every failure, whichever class
        return dict(status='error', error=type(e).__name__, message=' '.join(str(e).split())[:300])
    return dict(status='ok', error='', message='')


def run_child(model: str, mode: str, batches: Sequence[int], timeout: float, torchcompile: str = '') -> dict:
    """`trace_one` in a process of its own, killed after `timeout` seconds."""
    command = [sys.executable, os.path.abspath(__file__), '--one', model, '--modes', mode,
               '--batches', ','.join(map(str, batches))] + (['--torchcompile', torchcompile] if torchcompile else [])
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        row = dict(status='timeout', error='', message=f'over {timeout:.0f} s')
    else:
        last = done.stdout.strip().splitlines()[-1:] or ['']
        try:
            row = json.loads(last[0])
        except ValueError:  # the child died without its line
            tail = ' '.join(done.stderr.split()[-40:])[:300]
            row = dict(status='error', error=f'exit {done.returncode}', message=tail)
    return dict(row, seconds=f'{time.perf_counter() - started:.1f}')


def read_rows(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def report(rows: List[dict], torchcompile: str = '') -> List[str]:
    """The counts: families, ok per mode, the share of families that trace in every mode they have a row of, and
    each failure."""
    by_family = defaultdict(list)
    for r in rows:
        by_family[r['family']].append(r['status'] == 'ok')
    lines = [f'families: {len(by_family)}' + (f' (torch.compile {torchcompile})' if torchcompile else '')]
    for mode in MODES:
        mine = [r for r in rows if r['mode'] == mode]
        ok = sum(r['status'] == 'ok' for r in mine)
        lines.append(f'{mode}: {ok}/{len(mine)} ok' + (f' ({ok / len(mine):.1%})' if mine else ''))
    if by_family:
        traced = sum(all(oks) for oks in by_family.values())
        lines.append(f'families that trace{" compiled" if torchcompile else ""} in every mode: '
                     f'{traced}/{len(by_family)} ({traced / len(by_family):.1%})')
    for r in rows:
        if r['status'] != 'ok':
            lines.append(f'  {r["mode"]:8s} {r["family"]} ({r["model"]}): {r["status"]} {r["error"]} {r["message"]}')
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--batches', default='2,4', help='trace batch sizes, comma separated (at least two)')
    parser.add_argument('--families', default='', help='comma-separated families (default: all)')
    parser.add_argument('--limit', type=int, default=0, help='the first N families only')
    parser.add_argument('--shard', default='0/1', help='i/n: every n-th family from the i-th (n processes in parallel, '
                        'each with its own --output)')
    parser.add_argument('--modes', default=','.join(MODES), help='validate, train or both')
    parser.add_argument('--timeout', type=float, default=600, help='seconds a trace may take')
    parser.add_argument('--torchcompile', nargs='?', const='inductor', default='', metavar='BACKEND',
                        help='trace compiled as train.py --torchcompile (default backend inductor)')
    parser.add_argument('--output', default='', help=f'the CSV (default {os.path.relpath(OUTPUT, ROOT)}, '
                        f'{os.path.relpath(COMPILED_OUTPUT, ROOT)} with --torchcompile)')
    parser.add_argument('--fresh', action='store_true', help='trace again what the CSV has')
    parser.add_argument('--report', action='store_true', help='print the counts of the CSV and stop')
    parser.add_argument('--one', default='', help=argparse.SUPPRESS)  # the child: one model, one mode
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(','))
    modes = [m for m in args.modes.split(',') if m]
    output = args.output or (COMPILED_OUTPUT if args.torchcompile else OUTPUT)
    if args.one:
        print(json.dumps(trace_one(args.one, modes[0], batches, args.torchcompile)))
        return
    if args.report:
        print('\n'.join(report(read_rows(output), args.torchcompile)))
        return
    chosen = families()
    if args.families:
        chosen = {f: m for f, m in chosen.items() if f in args.families.split(',')}
    if args.limit:
        chosen = dict(list(chosen.items())[:args.limit])
    shard, shards = (int(n) for n in args.shard.split('/'))
    chosen = dict(list(chosen.items())[shard::shards])
    rows = [] if args.fresh else read_rows(output)
    done = {(r['family'], r['mode']) for r in rows}
    for family, model in chosen.items():
        for mode in modes:
            if (family, mode) in done:
                continue
            row = dict(family=family, model=model, mode=mode,
                       **run_child(model, mode, batches, args.timeout, args.torchcompile))
            rows = [r for r in rows if (r['family'], r['mode']) != (family, mode)] + [row]
            rows.sort(key=lambda r: (r['family'], MODES.index(r['mode'])))
            with open(output, 'w', newline='') as f:
                writer = csv.DictWriter(f, fieldnames=FIELDS)
                writer.writeheader()
                writer.writerows(rows)
            print(f'{family:28s} {model:34s} {mode:8s} {row["status"]} {row["seconds"]}s {row["message"][:120]}',
                  flush=True)
    print('\n'.join(report(rows, args.torchcompile)))


if __name__ == '__main__':
    main()
