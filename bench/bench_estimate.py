"""The memory estimate against real CPU trials: predicted largest batch vs a fresh-process oracle, per model.

    python bench/bench_estimate.py                       # six families, 1 GiB, oneDNN off and on
    python bench/bench_estimate.py --models resnet18:112 --budget 1GiB --onednn off
    python bench/bench_estimate.py --device cuda         # on a GPU: the CUDA estimate against max_memory_reserved

The oracle is the largest batch whose warm-up update and one timed update hold under the cap (RLIMIT_DATA), each
trial forked from a fresh process that has built the run with train.py's steady heap (as the probe's CPU trials are):
doubled, then bisected to within 2%. The estimate is `tune_batch.py --estimate`'s: the largest batch predicted within
the budget, no headroom. Memory figures only: nothing here is timed but the estimate itself.
"""
import argparse
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_MODELS = ('resnet18:112', 'efficientnet_b0:128', 'convnext_atto:128', 'vit_tiny_patch16_224:224',
                  'regnetx_004:128', 'mobilenetv3_large_100:128')
CALIBRATED_ON = {'resnet18', 'efficientnet_b0', 'vit_tiny_patch16_224'}  # the CPU constants' fit


CUDA_MODELS = ('resnet50:224', 'vit_small_patch16_224:224', 'efficientnet_b0:224', 'convnext_tiny:224')
CUDA_BATCHES = (32, 64, 128)
CUDA_CAP_GIB = 12.0  # the fraction cap the largest batch is searched under


def run_args(model: str, img: str, *extra: str):
    from timm_ext.train.args import parse_args
    args, _ = parse_args(['--model', model, '--img-size', img, '--device', 'cpu', '--num-classes', '1000', *extra])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    return args


def oracle(model: str, img: str, budget: str, onednn: bool, extra=(), start: int = 16) -> int:
    """The largest batch that holds under the cap, in a fresh process (this script, --oracle), for the run with the
    train.py flags `extra`, the search doubling from `start`."""
    cmd = [sys.executable, __file__, '--oracle', f'{model}:{img}', '--budget', budget, '--onednn',
           'on' if onednn else 'off', f'--oracle-flags={shlex.join(extra)}', '--oracle-start', str(start)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return int(out.strip().split()[-1])


def oracle_here(model: str, img: str, budget: str, onednn: bool, extra=(), start: int = 16) -> int:
    import torch
    from timm_ext.memory import PeakMeter, memory_cap, parse_budget, steady_cpu_heap
    from timm_ext.probe.measure import measured_trial
    from timm_ext.probe.trial import build_train_trial
    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = onednn
    steady_cpu_heap()  # as train.py's init_device does
    cpu = torch.device('cpu')
    setup = build_train_trial(run_args(model, img, *extra), cpu)
    with memory_cap(cpu, parse_budget(budget).resolve(cpu)) as cap:
        trial = measured_trial(setup.step, cpu, PeakMeter(cpu, cap.baseline), warmup_steps=1, timed_steps=1,
                               capped=True, before=setup.reset, isolate=True)
        fit, fail, size = 0, None, start
        while fail is None or fail - fit > max(1, fit // 50):
            if trial(size).fits:
                fit = size
            else:
                fail = size
            size = size * 2 if fail is None else (fit + fail) // 2
    return fit


def cuda_check(models, batches, cap_gib: float = CUDA_CAP_GIB) -> int:
    """The CUDA model on a GPU, measured as the probe measures (cuDNN's benchmark search before the window):
    the predicted peak against `max_memory_reserved` at a few batches, then the largest batch that really holds under
    a `set_per_process_memory_fraction` cap of `cap_gib`, searched from the prediction (--amp, AdamW)."""
    import torch
    from timm_ext.cuda_backends import configure_cuda_backends
    from timm_ext.memory import PeakMeter, format_bytes, free_memory
    from timm_ext.memory_model.estimate import estimate_memory
    from timm_ext.probe.measure import measured_trial
    from timm_ext.probe.trial import build_train_trial
    extra = ('--amp', '--opt', 'adamw')
    # every trace first: a trace runs in a forked child, which must not inherit a CUDA context
    estimates = {spec: estimate_memory(run_args(*spec.split(':'), *extra), 'cuda') for spec in models}
    device = torch.device('cuda')
    configure_cuda_backends(device)
    cap = int(cap_gib * (1 << 30))
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(device).total_memory)
    print(f'| model | batch | estimate | max_memory_reserved | estimate / reserved |   (cap {cap_gib} GiB)')
    print('|---|---|---|---|---|')
    ratios, largest = [], []
    for spec, estimate in estimates.items():
        args = run_args(*spec.split(':'), *extra, '--device', 'cuda')
        setup = build_train_trial(args, device)
        trial = measured_trial(setup.step, device, PeakMeter(device), warmup_steps=1, timed_steps=1,
                               before=setup.reset, benchmark_warmup=True)
        for batch in batches:
            real = trial(batch)
            if not real.fits:
                print(f'| {spec} | {batch} | {format_bytes(estimate.peak(batch))} | {real.status} | - |')
                continue
            ratios.append(estimate.peak(batch) / real.peak_bytes)
            print(f'| {spec} | {batch} | {format_bytes(estimate.peak(batch))} | {format_bytes(real.peak_bytes)} | '
                  f'{ratios[-1]:.2f} |', flush=True)
        # a fraction caps the allocator alone: the context is outside it, so the prediction plans in the whole cap
        predicted = estimate.largest_batch(cap)
        real = largest_near(trial, predicted)
        largest.append(predicted / max(1, real))
        print(f'| {spec} | largest under the cap | predicted {predicted} | holds {real} | '
              f'{predicted / max(1, real):.2f} |', flush=True)
        del setup, trial
        free_memory(device)
    if not ratios:
        print('RESULT: no trial fitted')
        return 1
    print(f'RESULT: estimate / max_memory_reserved {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} trials; '
          f'predicted / real largest batch {min(largest):.2f}-{max(largest):.2f} over {len(largest)} models')
    return 0


def largest_near(trial, predicted: int, step: float = 0.04, most: int = 8) -> int:
    """The largest batch that holds, searched from `predicted` in steps of `step` (then bisected), `most` trials."""
    fit, fail, size = 0, None, max(1, predicted)
    for _ in range(most):
        if trial(size).fits:
            fit = size
        else:
            fail = size
        if fail is not None and fail - fit <= max(1, fit // 50):
            break
        if fail is None:
            size = max(size + 1, int(size * (1 + step)))
        elif fit == 0:
            size = max(1, int(size * (1 - step)))
        else:
            size = (fit + fail) // 2
    return fit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', nargs='+', default=list(DEFAULT_MODELS), metavar='MODEL:IMG')
    parser.add_argument('--budget', default='1GiB')
    parser.add_argument('--onednn', choices=('off', 'on', 'both'), default='both')
    parser.add_argument('--device', choices=('cpu', 'cuda'), default='cpu',
                        help='cuda: the CUDA model against max_memory_reserved on this GPU (models: CUDA_MODELS)')
    parser.add_argument('--oracle', default=None, help=argparse.SUPPRESS)
    parser.add_argument('--oracle-flags', default='', help=argparse.SUPPRESS)
    parser.add_argument('--oracle-start', type=int, default=16, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == 'cuda':
        models = args.models if args.models != list(DEFAULT_MODELS) else list(CUDA_MODELS)
        return cuda_check(models, CUDA_BATCHES)
    if args.oracle:
        print(oracle_here(*args.oracle.split(':'), args.budget, args.onednn == 'on', shlex.split(args.oracle_flags),
                          args.oracle_start))
        return 0
    from timm_ext.memory import parse_budget
    from timm_ext.memory_model.estimate import estimate_memory
    budget = parse_budget(args.budget).num_bytes
    settings = {'off': [False], 'on': [True], 'both': [False, True]}[args.onednn]
    print('| model | img | oneDNN | estimate | oracle | estimate / oracle | estimate s | calibration |')
    print('|---|---|---|---|---|---|---|---|')
    for spec in args.models:
        model, img = spec.split(':')
        for onednn in settings:
            started = time.perf_counter()
            predicted = estimate_memory(run_args(model, img), 'cpu', onednn).largest_batch(budget)
            seconds = time.perf_counter() - started
            real = oracle(model, img, args.budget, onednn)
            role = 'fitted on' if model in CALIBRATED_ON else 'held out'
            print(f'| {model} | {img} | {"on" if onednn else "off"} | {predicted} | {real} | {predicted / real:.2f} | '
                  f'{seconds:.1f} | {role} |', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
