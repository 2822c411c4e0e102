"""How long `tune_batch.py --estimate` takes, savers table on, and where it spends (issue 39: answers in seconds).

    python bench/bench_estimate_speed.py                    # resnet50 and vit_base_patch16_224, best of 3, timed
    python bench/bench_estimate_speed.py --repeats 5 --output speed.json
    python bench/bench_estimate_speed.py --profile resnet50 # no timing: cProfile's call counts and shares
    python bench/bench_estimate_speed.py --torchcompile --models resnet50   # the compiled plan for an RTX 4090

Timed: each model's whole command (`--device cuda --mem-budget 24GiB --estimate --savers`, a fresh process: imports,
traces, replays, the table), best of `--repeats`, run one after another; the figures go to `--output` (JSON) and
stdout. `--torchcompile` times the compiled plan instead (`--amp --torchcompile --gpu rtx4090`, issue 48's command):
inductor lowers, schedules and generates the step's graphs for the card, so its cold compile is most of the time.
Time it on quiet cores only: a shared machine times the other sessions.

`--profile MODEL` runs the same command in this process under cProfile, its traces in this process too, one after
another (a forked trace would hide its work from the profiler), and prints how many times each stage ran (traces,
replays, the allocator's bisections) and the functions with the largest share of the profile's total: shares, not
seconds. The profile is also written as `<output folder>/<MODEL>.pstats` for pstats' callers and callees.
"""
import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = ('resnet50', 'vit_base_patch16_224')
TARGET_SECONDS = {'resnet50': 10.0, 'vit_base_patch16_224': 20.0}  # issue 39, item 6, on 2 quiet cores
COMPILED_TARGET_SECONDS = {'resnet50': 40.0}  # issue 48, on 2 quiet cores
BUDGET = '24GiB'
COMPILED = ('--amp', '--torchcompile', '--gpu', 'rtx4090')  # the card's memory is the budget
STAGES = {  # what to count in a profile: (module file's tail, function)
    'traces (build + fake-tensor steps)': ('memory_model/estimate.py', '_trace'),
    'traced steps': ('train/trial_steps.py', 'step'),
    'replays of a step log': ('memory_model/replay.py', 'replay'),
    'least_memory bisections': ('memory_model/replay.py', 'least_memory'),
    'largest_batch searches': ('memory_model/replay.py', 'largest_batch'),
    'scaled logs read': ('memory_model/events.py', 'at'),
}
TOP = 25


def command(model: str, output_dir: str, *extra: str) -> List[str]:
    """tune_batch.py's arguments for the timed plan (the script's path first)."""
    budget = () if '--gpu' in extra else ('--mem-budget', BUDGET)
    return [os.path.join(ROOT, 'tune_batch.py'), '--model', model, '--device', 'cuda', *budget,
            '--estimate', '--tuned-config', os.path.join(output_dir, f'{model}.yaml'), *extra]


def time_models(models: List[str], repeats: int, output_dir: str, extra: List[str]) -> Dict[str, dict]:
    """Each model's best, median and every wall time of the whole command, in fresh processes."""
    targets = COMPILED_TARGET_SECONDS if '--torchcompile' in extra else TARGET_SECONDS
    figures = {}
    for model in models:
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            subprocess.run([sys.executable, *command(model, output_dir, *extra)], check=True, capture_output=True)
            seconds.append(time.perf_counter() - started)
        figures[model] = dict(best=min(seconds), median=sorted(seconds)[len(seconds) // 2], all=seconds,
                              target=targets.get(model))
        print(f'{model}: best {min(seconds):.1f} s of {repeats} (target {targets.get(model, "-")} s)',
              flush=True)
    return figures


def profile(model: str, output_dir: str, extra: List[str]) -> None:
    """The command in this process under cProfile: how often each stage ran and the largest cumulative shares."""
    import timm_ext.memory_model.estimate as estimate
    import tune_batch

    def in_process(fn, *args):  # the trace in this process, so the profile sees it
        return json.loads(json.dumps(fn(*args)))
    estimate.in_child = in_process
    try:  # traces in this process run one after another (a tree from before the pool profiles as it is)
        import timm_ext.memory_model.trace_pool as trace_pool
        trace_pool.fork_runs_autograd = lambda: False
    except ImportError:
        pass
    profiler = cProfile.Profile()
    profiler.enable()
    tune_batch.main(command(model, output_dir, *extra)[1:])
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.dump_stats(os.path.join(output_dir, f'{model}.pstats'))  # for pstats' callers and callees
    total = stats.total_tt
    print('\nProfile of tune_batch.py', *command(model, output_dir, *extra)[1:])
    print('Stage counts (calls) and shares of the profile (cumulative):')
    for label, (tail, name) in STAGES.items():
        calls = cumulative = 0
        for (path, _, function), (_, ncalls, _, cum, _) in stats.stats.items():
            if function == name and path.endswith(tail):
                calls, cumulative = calls + ncalls, max(cumulative, cum)
        print(f'  {label:<40s} {calls:>7d} calls {cumulative / total:>7.1%}')
    print(f'Largest cumulative shares (top {TOP}):')
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][3])[:TOP]
    for (path, line, function), (_, ncalls, _, cum, _) in rows:
        where = os.path.relpath(path, ROOT) if path.startswith(ROOT) else os.path.basename(path)
        print(f'  {cum / total:>7.1%} {ncalls:>9d}  {where}:{line} {function}')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--models', nargs='+', default=list(MODELS))
    parser.add_argument('--repeats', type=int, default=3, help='runs a model; the best is the figure')
    parser.add_argument('--output', default=os.path.join(ROOT, 'output', 'bench', 'estimate_speed.json'))
    parser.add_argument('--profile', default=None, metavar='MODEL', help='profile one model instead of timing')
    parser.add_argument('--no-savers', action='store_true', help='leave the savers table to the plan (no --savers)')
    parser.add_argument('--torchcompile', action='store_true', help='time the compiled plan for an RTX 4090')
    args = parser.parse_args()
    output_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(output_dir, exist_ok=True)
    extra = ([] if args.no_savers else ['--savers']) + (list(COMPILED) if args.torchcompile else [])
    if args.profile:
        profile(args.profile, output_dir, extra)
        return 0
    figures = time_models(args.models, args.repeats, output_dir, extra)
    with open(args.output, 'w') as f:
        json.dump(dict(budget='rtx4090' if args.torchcompile else BUDGET, compiled=args.torchcompile,
                       savers_table=not args.no_savers, cpus=os.cpu_count(), models=figures), f, indent=1)
    print(f'Written: {args.output}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
