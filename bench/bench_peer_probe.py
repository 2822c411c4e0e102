#!/usr/bin/env python3
"""Our batch probe side by side with Lightning's BatchSizeFinder and Accelerate's find_executable_batch_size.

Every method runs in its own fresh process under the same real memory cap (RLIMIT_DATA set to the process's data
segment after the model is built, plus the budget), on the same model, optimizer, input size and random data, with
one CPU thread:

* ours: `timm_ext.probe.train_probe.probe_train_batch` as tune_batch.py runs it (`--headroom`, default as there: 5% on
  CPU; --select max; the device's default grid; a warm-up and tune_batch's 3 timed updates per trial), and today's
  search for the trial count it must not exceed (grow x2 from 2, then bisect on the decay grid, the same trial and
  headroom, no aiming).
* lightning-binsearch / lightning-power: `Tuner.scale_batch_size` (init 2, 3 steps per trial, 25 trials, its 5%
  margin) on a LightningModule around the same timm model.
* accelerate: `find_executable_batch_size` from `--accelerate-start` around 3 training steps (x0.9 on each OOM).

The peers are never dependencies of this project: they run with the python of a separate virtual environment
(`--peer-python`, default `.venv-peers/bin/python`):

    python3 -m venv .venv-peers && .venv-peers/bin/pip install -r requirements.txt lightning accelerate

Then, for every batch found, the hold check: `--survival-runs` fresh processes (default 10) under the same cap each
run `--updates` real training updates (default 3: forward, backward, optimizer step) at that size. The oracle is the
largest integer batch whose fresh process survives `--updates` updates: a bracket around `--oracle-hint` (or outward
from 64) in steps of 10%, then a bisection on integers. Every process of ours (probe, hold check, oracle) sets up
its device as train.py does, glibc's steady heap included (`timm_ext.memory.steady_cpu_heap`). A peer that dies
(a signal, or an error it does not take for out-of-memory, such as oneDNN's "could not create a primitive" under a
cap) is reported as it died, with its last line of stderr.

    python bench/bench_peer_probe.py --list
    python bench/bench_peer_probe.py --config test_resnet-64        # one configuration per command
Results are printed as a table and saved to bench/results/bench_peer_probe-<config>.json.
"""
import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'bench'))

# name: (model, img size, optimizer, budget); CPU, under RLIMIT_DATA
CONFIGS = {
    'resnet18-112': ('resnet18', 112, 'sgd', '1GiB'),  # the case: 106 survives real updates
    'test_vit-64': ('test_vit', 64, 'adamw', '96MiB'),
    'test_resnet-64': ('test_resnet', 64, 'sgd', '160MiB'),
    'test_convnext-64': ('test_convnext', 64, 'sgd', '128MiB'),
}
NUM_CLASSES = 10
PEER_METHODS = ('lightning-binsearch', 'lightning-power', 'accelerate')
METHODS = ('ours', 'today') + PEER_METHODS


def train_flags(config: str) -> list:
    model, img_size, opt, _ = CONFIGS[config]
    flags = ['--model', model, '--img-size', str(img_size), '--opt', opt, '--device', 'cpu']
    if model == 'test_vit':
        flags += ['--model-kwargs', f'img_size={img_size}']
    return flags


# ---- workers: each runs in a fresh process and prints one JSON line

def worker_ours(config: str, aim: bool, headroom: Optional[float]) -> dict:
    """Our probe (aim) or today's grow-then-bisect on the decay grid (no aim), same trial and headroom."""
    from bench_probe import capped_trial, setup_trial
    from timm_ext.memory import default_headroom, memory_cap, parse_budget
    from timm_ext.probe.grids import DecayGrid
    from timm_ext.probe.search import search_batch_size
    from timm_ext.probe.selection import headroom_accept, select_batch_size
    from timm_ext.probe.train_probe import probe_train_batch
    from timm_ext.tune.tuner import TIMED_STEPS
    setup = setup_trial(train_flags(config))
    budget = parse_budget(CONFIGS[config][3])
    headroom = default_headroom(setup.device) if headroom is None else headroom  # tune_batch.py's default
    start = time.perf_counter()
    if aim:
        trials = probe_train_batch(setup, budget, headroom=headroom, select='max', start=2,
                                   timed_steps=TIMED_STEPS).trials
    else:
        budget_bytes = budget.resolve(setup.device)
        with memory_cap(setup.device, budget_bytes) as cap:
            trials = search_batch_size(capped_trial(setup, cap, TIMED_STEPS), 2, grid=DecayGrid(),
                                       accept=headroom_accept(budget_bytes, headroom))
    seconds = time.perf_counter() - start
    return {'found': select_batch_size(trials).batch_size, 'trials': len(trials), 'seconds': seconds,
            'sizes': [t.batch_size for t in trials], 'headroom': headroom}


PEER_WORKER = r'''
import gc, json, resource, sys, time
import timm, torch
import torch.nn.functional as F
from timm.optim import create_optimizer_v2

method, model_name, img_size, opt_name, budget, start, num_classes = sys.argv[1:8]
img_size, budget, start, num_classes = int(img_size), int(budget), int(start), int(num_classes)
torch.set_num_threads(1)
torch.manual_seed(0)
kwargs = {'img_size': img_size} if model_name == 'test_vit' else {}
model = timm.create_model(model_name, num_classes=num_classes, **kwargs)
model.train()
optimizer = create_optimizer_v2(model, opt=opt_name, lr=0.01, weight_decay=2e-5, momentum=0.9)
sizes = []


class RandomImages(torch.utils.data.Dataset):
    """Random images, made when asked (no memory held): long enough for any batch Lightning may try."""

    def __len__(self):
        return 1 << 16

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index)
        return torch.randn(3, img_size, img_size, generator=g), int(torch.randint(num_classes, (1,), generator=g))


def collate(rows):
    sizes.append(len(rows))  # a trial is a run of equal sizes; a batch that fails to collate still counts
    return torch.utils.data.default_collate(rows)


def cap_now():
    with open('/proc/self/status') as f:
        vm_data = next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmData'))
    resource.setrlimit(resource.RLIMIT_DATA, (vm_data + budget, resource.RLIM_INFINITY))


if method.startswith('lightning'):
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.batch_size = model, 2

        def train_dataloader(self):
            return torch.utils.data.DataLoader(RandomImages(), batch_size=self.batch_size, collate_fn=collate)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return optimizer

    trainer = pl.Trainer(accelerator='cpu', devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    module = Module()
    cap_now()
    began = time.perf_counter()
    found = Tuner(trainer).scale_batch_size(module, mode=method.split('-')[1], init_val=2, steps_per_trial=3,
                                            max_trials=25)
else:
    from accelerate.utils import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=start)
    def train(batch_size):
        for _ in range(3):
            x = torch.randn(batch_size, 3, img_size, img_size)
            sizes.append(batch_size)
            loss = F.cross_entropy(model(x), torch.randint(num_classes, (batch_size,)))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return batch_size

    cap_now()
    began = time.perf_counter()
    found = train()
seconds = time.perf_counter() - began
trials = [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s]
print(json.dumps({'found': found, 'trials': len(trials), 'seconds': seconds, 'sizes': trials}))
'''


# ---- the parent: fresh processes, one per measurement

def run_fresh(argv: list, timeout: float) -> dict:
    """Run `argv` in a fresh process (one CPU thread); its last stdout line as JSON, or how it died."""
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO)}
    began = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {'crashed': f'timed out after {timeout:.0f} s'}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr.strip().splitlines() or [''])[-1][:240]
    how = f'killed by {signal.Signals(-proc.returncode).name}' if proc.returncode < 0 else \
        f'exit {proc.returncode}'
    return {'crashed': f'{how}: {tail}', 'wall_s': time.perf_counter() - began}


def ours(config: str, aim: bool, headroom: Optional[float], timeout: float) -> dict:
    return run_fresh([sys.executable, __file__, '--worker', json.dumps(['ours', config, aim, headroom])], timeout)


def peer(config: str, method: str, opts) -> dict:
    model, img_size, opt, budget = CONFIGS[config]
    from timm_ext.memory import parse_budget
    budget_bytes = parse_budget(budget).num_bytes
    return run_fresh([opts.peer_python, '-c', PEER_WORKER, method, model, str(img_size), opt, str(budget_bytes),
                      str(opts.accelerate_start), str(NUM_CLASSES)], opts.timeout)


def holds(config: str, batch_size: int, updates: int, runs: int, timeout: float) -> dict:
    """`batch_size` trained in `runs` fresh processes under the config's cap (`bench_probe.hold_check`)."""
    from bench_probe import hold_check
    return hold_check(train_flags(config), CONFIGS[config][3], batch_size, runs, updates, timeout)


def oracle(config: str, hint: int, updates: int, timeout: float) -> dict:
    """The largest integer batch whose fresh process survives `updates` updates: bracket around `hint` in steps of
    10%, then bisect on integers (the boundary is assumed monotonic; on CPU it moves a little between processes)."""
    checked = {}

    def survives(size: int) -> bool:
        if size not in checked:
            checked[size] = holds(config, size, updates, 1, timeout)['held'] == 1
            print(f'   oracle: {size} {"holds" if checked[size] else "fails"}', flush=True)
        return checked[size]

    low, high = (hint, None) if survives(hint) else (None, hint)
    while high is None:
        step = max(low + 1, math.ceil(low * 1.1))
        low, high = (step, None) if survives(step) else (low, step)
    while low is None:
        step = max(1, math.floor(high / 1.1))
        if step == high:
            return {'oracle': 0, 'checked': checked}
        low, high = (step, high) if survives(step) else (None, step)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if survives(middle) else (low, middle)
    return {'oracle': low, 'checked': checked}


def describe(result: dict) -> str:
    return result.get('crashed', '')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', choices=sorted(CONFIGS), default='test_resnet-64')
    parser.add_argument('--list', action='store_true', help='print the configurations and exit')
    parser.add_argument('--methods', default=','.join(METHODS), help=f'comma-separated, of {", ".join(METHODS)}')
    parser.add_argument('--peer-python', default=str(REPO / '.venv-peers' / 'bin' / 'python'),
                        help='python of the separate venv that has lightning and accelerate')
    parser.add_argument('--accelerate-start', type=int, default=1024, metavar='N',
                        help="Accelerate's starting_batch_size (its default is 128)")
    parser.add_argument('--headroom', type=float, default=None, metavar='FRAC',
                        help="our probe's --mem-headroom (and today's search's), judged on measured peaks "
                             "(default: tune_batch.py's)")
    parser.add_argument('--updates', type=int, default=3, help='real updates a found batch must survive')
    parser.add_argument('--survival-runs', type=int, default=10, help='fresh processes checking each found batch')
    parser.add_argument('--oracle-hint', type=int, default=None, metavar='N',
                        help='where the oracle starts its bracket (default: our probe\'s choice, else 64)')
    parser.add_argument('--no-oracle', action='store_true', help='skip the oracle (found sizes and survival only)')
    parser.add_argument('--timeout', type=float, default=300.0, help='seconds for any one fresh process')
    parser.add_argument('--worker', default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        name, *argv = json.loads(opts.worker)
        print(json.dumps(worker_ours(*argv)))
        return
    if opts.list:
        for name, (model, img, opt, budget) in CONFIGS.items():
            print(f'{name}: {model} at {img} px, {opt}, budget {budget} (RLIMIT_DATA)')
        return
    methods = [m for m in opts.methods.split(',') if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f'unknown methods {sorted(unknown)}; choose from {METHODS}')
    if any(m in PEER_METHODS for m in methods) and not Path(opts.peer_python).exists():
        parser.error(f'{opts.peer_python} not found; make the peers\' venv first (see the docstring)')

    config = opts.config
    print(f'== {config}: {CONFIGS[config]}', flush=True)
    rows = {}
    for method in methods:
        res = ours(config, method == 'ours', opts.headroom, opts.timeout) if method in ('ours', 'today') else \
            peer(config, method, opts)
        if 'found' in res and res['found']:
            res['hold'] = holds(config, res['found'], opts.updates, opts.survival_runs, opts.timeout)
        rows[method] = res
        print(f'   {method}: {json.dumps(res)}', flush=True)
    report = {'config': config, 'setup': CONFIGS[config], 'headroom_ours': opts.headroom, 'updates': opts.updates,
              'methods': rows}
    if not opts.no_oracle:
        hint = opts.oracle_hint or rows.get('ours', {}).get('found') or 64
        report['oracle'] = oracle(config, hint, opts.updates, opts.timeout)
    best = report.get('oracle', {}).get('oracle')
    print(f'\noracle ({opts.updates} updates in a fresh process): {best if best is not None else "not run"}')
    print(f'| method | found | % of oracle | trials | wall s | held ({opts.updates} updates, fresh processes) | note |')
    print('|---|---|---|---|---|---|---|')
    for method, res in rows.items():
        found, hold = res.get('found'), res.get('hold')
        share = f'{found / best:.0%}' if found and best else '-'
        held = f'{hold["held"]}/{hold["runs"]}' if hold else '-'
        if hold and hold['failures']:
            held += f' ({hold["failures"][0][:60]})'
        wall = f'{res["seconds"]:.1f}' if 'seconds' in res else '-'
        print(f'| {method} | {found or "-"} | {share} | {res.get("trials", "-")} | {wall} | {held} '
              f'| {describe(res)} |')
    mine = rows.get('ours', {})
    if mine.get('hold') and best:
        promise = mine['hold']['held'] == mine['hold']['runs'] and mine['found'] >= 0.9 * best
        print(f'\nours: held {mine["hold"]["held"]}/{mine["hold"]["runs"]}, {mine["found"] / best:.0%} of the oracle: '
              f'{"the promise holds" if promise else "NOT the promise (every run holds, >= 90% of the oracle)"}')
    out = REPO / 'bench' / 'results'
    out.mkdir(parents=True, exist_ok=True)
    (out / f'bench_peer_probe-{config}.json').write_text(json.dumps(report, indent=2))


if __name__ == '__main__':
    main()
