#!/usr/bin/env python3
"""What a dynamic-batch compiled training step holds against a static one at the same batch (CPU inductor).

For each model and batch, one fresh process per way of compiling (`torch.compile` of the model, as timm's task
compiles it, the loss and SGD with momentum eager):

- static: `dynamic=False`, a graph for this batch alone (what train.py runs at its fixed batch);
- batch: `dynamic=None` with `torch._dynamo.mark_dynamic` on the input's batch dimension, first run at a smaller
  batch (`--compile-batch`), then at the measured one (inductor guards a graph on the size range its code was
  generated for, so the measured batch may get a dynamic graph of its own, as a probe's trial does);
- dynamic: `dynamic=True` (every dimension symbolic), run the same way.

Measured on this CPU (2 shared cores, torch 2.14.1, float32, SGD momentum; peak above the update's start, MiB):
test_resnet 64 px b24 22.02 static, 22.02 batch, 24.30 dynamic=True; b48 41.18, 41.18, 47.18; resnet18 64 px b48
137.06, 137.06, 137.44; vit_tiny 64 px b48 123.56, 123.57, 123.57; vit_tiny 96 px b48 267.93, 267.93, 267.93. The
batch dimension alone dynamic holds what the static graph holds; every dimension dynamic holds up to 15% more.

Each process runs two warm-up updates (the compile, the optimizer state), then profiles one update with
`torch.profiler`'s memory events: the figure is the peak of live bytes over that update above what was live at its
start (parameters, optimizer state), which is the same for every way.

    python bench/bench_compile_dynamic.py                 # resnet18 64 px, vit_tiny 64 and 96 px, test_resnet 64 px
Results are printed and saved to bench/results/bench_compile_dynamic.json.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / 'bench'))

from common import write_result  # noqa: E402

CONFIGS = [
    # (name, timm model, model kwargs, image size, measured batches)
    ('test_resnet 64px', 'test_resnet', {}, 64, [24, 48]),
    ('resnet18 64px', 'resnet18', {}, 64, [48]),
    ('vit_tiny 64px', 'vit_tiny_patch16_224', {'img_size': 64}, 64, [48]),
    ('vit_tiny 96px', 'vit_tiny_patch16_224', {'img_size': 96}, 96, [48]),
]
WAYS = ('static', 'batch', 'dynamic')


def measure(model_name: str, kwargs: dict, img: int, batch: int, way: str, compile_batch: int) -> dict:
    """One process's figure: peak live bytes above the update's start, and what was live at its start."""
    import torch
    import timm
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = timm.create_model(model_name, num_classes=10, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    compiled = torch.compile(model, dynamic={'static': False, 'batch': None, 'dynamic': True}[way])
    loss_fn = torch.nn.CrossEntropyLoss()

    def update(rows: int) -> None:
        x = torch.randn(rows, 3, img, img)
        if way == 'batch':
            torch._dynamo.mark_dynamic(x, 0)
        y = torch.randint(0, 10, (rows,))
        optimizer.zero_grad(set_to_none=True)
        loss_fn(compiled(x), y).backward()
        optimizer.step()

    update(batch if way == 'static' else compile_batch)  # the compile
    update(batch)
    optimizer.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        update(batch)
    live = peak = 0
    for _, size in sorted(_allocations(prof.profiler.kineto_results.experimental_event_tree())):
        live += size
        peak = max(peak, live)
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    resident += sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t))
    return dict(peak_above_start=peak, resident=resident, frames=len(torch._dynamo.utils.counters['frames']))


def _allocations(nodes) -> List[tuple]:
    """(time, bytes) of every allocation (positive) and free (negative) the profiler recorded under `nodes`."""
    from torch._C._profiler import _EventType
    found = []
    for node in nodes:
        if node.typed[0] == _EventType.Allocation:
            found.append((node.start_time_ns, node.typed[1].alloc_size))
        found += _allocations(node.children)
    return found


def child(argv: List[str]) -> None:
    spec = json.loads(argv[0])
    print(json.dumps(measure(**spec)))


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--compile-batch', type=int, default=8, help='batch the dynamic ways compile at')
    parser.add_argument('--only', default=None, help='run only the configurations whose name contains this')
    parser.add_argument('--output', default=str(REPO / 'bench' / 'results' / 'bench_compile_dynamic.json'))
    args = parser.parse_args(argv)
    rows = []
    cache = tempfile.mkdtemp(prefix='inductor_dyn_')
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'TORCHINDUCTOR_CACHE_DIR': cache, 'PYTHONPATH': str(REPO)}
    for name, model, kwargs, img, batches in CONFIGS:
        if args.only and args.only not in name:
            continue
        for batch in batches:
            row = dict(name=name, rows=batch)
            for way in WAYS:
                spec = dict(model_name=model, kwargs=kwargs, img=img, batch=batch, way=way,
                            compile_batch=args.compile_batch)
                done = subprocess.run([sys.executable, __file__, '--child', json.dumps(spec)], capture_output=True,
                                      text=True, env=env)
                if done.returncode != 0:
                    row[way] = None
                    print(f'{name} b{batch} {way}: failed: {done.stderr.strip().splitlines()[-1:]}', flush=True)
                    continue
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                row[way] = figures['peak_above_start']
                row['resident'] = figures['resident']
                print(f'{name} b{batch} {way}: {figures["peak_above_start"] / 2**20:.2f} MiB above '
                      f'{figures["resident"] / 2**20:.2f} MiB resident', flush=True)
            rows.append(row)
    print('\n| configuration | batch | static MiB | batch-dynamic MiB (/ static) | dynamic=True MiB (/ static) |')
    print('| --- | --- | --- | --- | --- |')
    for r in rows:
        cells = []
        for way in ('batch', 'dynamic'):
            value = r.get(way)
            cells.append('failed' if value is None or not r.get('static') else
                         f'{value / 2**20:.2f} ({value / r["static"]:.3f})')
        static = f'{r["static"] / 2**20:.2f}' if r.get('static') else 'failed'
        print(f'| {r["name"]} | {r["rows"]} | {static} | {cells[0]} | {cells[1]} |')
    write_result(args.output, dict(compile_batch=args.compile_batch, rows=rows))


if __name__ == '__main__':
    if len(sys.argv) > 2 and sys.argv[1] == '--child':
        child(sys.argv[2:])
    else:
        main()
