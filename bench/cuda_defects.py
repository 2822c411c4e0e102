"""The CUDA checks behind issue 21 that only a GPU can run (called by bench/gpu_check.sh, one process each).

    python bench/cuda_defects.py peak          a probe trial's peak with cuDNN's benchmark search inside the measured
                                               window and outside it (each in a fresh process: the search runs once
                                               per shape and process), and the budget before / after the first step
    python bench/cuda_defects.py stop-cost     samples/s of a training loop with the old per-update stop flag (an
                                               all-reduce read on the host) and without it, on a 1-rank NCCL group
    python bench/cuda_defects.py sticky-error  a trial that breaks the CUDA context (a device-side assert): it must be
                                               reported as an error trial, and the cleanup after it must not raise

Each prints its figures and ends with one line 'RESULT: ...'; the exit status is 1 when the check fails.
"""
import argparse
import os
import socket
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from timm_ext.cuda_backends import configure_cuda_backends  # noqa: E402
from timm_ext.memory import PeakMeter, device_broken, format_bytes, free_memory, memory_cap, parse_budget  # noqa: E402
from timm_ext.probe.measure import measured_trial  # noqa: E402
from timm_ext.probe.table import ERROR, FIT  # noqa: E402

TRAIN = ['--model', 'resnet50', '--img-size', '224', '--num-classes', '3', '--amp', '--device', 'cuda']
PEAK_BATCH = 96
BUDGET = '0.5'


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='cuda_defects.py', description=__doc__.split('\n')[0])
    sub = parser.add_subparsers(dest='check', required=True)
    sub.add_parser('peak')
    one = sub.add_parser('peak-one')  # one trial in this process (what `peak` runs twice)
    one.add_argument('--benchmark-warmup', type=int, choices=(0, 1), required=True)
    stop = sub.add_parser('stop-cost')
    stop.add_argument('--updates', type=int, default=120)
    sub.add_parser('sticky-error')
    return parser


def _trial_setup():
    from timm_ext.distributed import init_device
    from timm_ext.probe.trial import build_train_trial
    from timm_ext.train.args import parse_args
    args, _ = parse_args(TRAIN)
    args, device = init_device(args)
    configure_cuda_backends(device)
    return build_train_trial(args, device), device


def peak_one(benchmark_warmup: bool) -> int:
    from timm_ext.probe.train_probe import check_step_runs
    setup, device = _trial_setup()
    budget = parse_budget(BUDGET)
    before = budget.resolve(device)
    check_step_runs(setup)  # batch 2: its shapes' search only
    after = budget.resolve(device)
    with memory_cap(device, after) as cap:
        trial = measured_trial(setup.step, device, PeakMeter(device, cap.baseline), warmup_steps=1, timed_steps=2,
                               capped=True, before=setup.reset, warmup=setup.warmup,
                               benchmark_warmup=benchmark_warmup)(PEAK_BATCH)
    print(f'budget {BUDGET}: {format_bytes(before)} before the first step, {format_bytes(after)} after it')
    print(f'PEAK {trial.status} {trial.peak_bytes or 0} {trial.error or ""}')
    return 0 if trial.status == FIT else 1


def peak() -> int:
    peaks = {}
    for warm in (0, 1):
        out = subprocess.run([sys.executable, __file__, 'peak-one', '--benchmark-warmup', str(warm)],
                             capture_output=True, text=True, timeout=240)
        sys.stdout.write(out.stdout)
        line = next((x for x in out.stdout.splitlines() if x.startswith('PEAK ')), None)
        if out.returncode != 0 or line is None:
            print(f'RESULT: the trial with benchmark warm-up {warm} failed: {(line or out.stderr[-300:]).strip()}')
            return 1
        peaks[warm] = int(line.split()[2])
    print(f'RESULT: batch {PEAK_BATCH} peak {format_bytes(peaks[0])} with the cuDNN search in the window, '
          f'{format_bytes(peaks[1])} with it outside ({peaks[0] - peaks[1]:+,} bytes)')
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def stop_cost(updates: int) -> int:
    import timm
    import torch.distributed as dist
    device = torch.device('cuda')
    configure_cuda_backends(device)
    dist.init_process_group('nccl', init_method=f'tcp://127.0.0.1:{_free_port()}', rank=0, world_size=1,
                            device_id=device)
    model = timm.create_model('resnet18', num_classes=10).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 3, 128, 128, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (64,), device=device)

    def run(with_flag: bool) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(updates):
            with torch.autocast('cuda', dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if with_flag:  # what every update paid before: the flag all-reduced and read on the host
                flag = torch.tensor(0, device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                int(flag.item())
        torch.cuda.synchronize()
        return updates * x.shape[0] / (time.perf_counter() - start)

    run(False)  # warm-up: cuDNN search, allocator
    rates = {flag: max(run(flag) for _ in range(2)) for flag in (True, False)}
    dist.destroy_process_group()
    print(f'RESULT: resnet18 128 px b64 bf16: {rates[True]:.0f} samples/s with the per-update stop flag, '
          f'{rates[False]:.0f} without ({rates[False] / rates[True] - 1:+.1%})')
    return 0


def sticky_error() -> int:
    device = torch.device('cuda')
    small = torch.zeros(4, device=device)

    def step(batch_size: int) -> None:
        small[torch.full((batch_size,), 10, device=device)] += 1  # out of bounds: a device-side assert
        torch.cuda.synchronize()

    try:
        trial = measured_trial(step, device)(8)
    except Exception as e:  # the defect: the cleanup raised again
        print(f'RESULT: the trial raised instead of reporting: {type(e).__name__}: {str(e).splitlines()[0]}')
        return 1
    broken = device_broken(device)
    try:
        free_memory(device)
        unguarded = 'did not raise (the context was not left broken here)'
    except Exception as e:  # noqa: BLE001 - shows what the guard keeps from the user
        unguarded = f'raises {type(e).__name__} (what the guard keeps from the user)'
    ok = trial.status == ERROR
    print(f'trial: {trial.status}: {trial.error}')
    print(f'RESULT: {"error trial reported in one line" if ok else "wrong status " + trial.status}; device broken '
          f'{broken}; an unguarded free_memory {unguarded}')
    return 0 if ok else 1


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print('cuda_defects.py: error: no CUDA device; this check needs one GPU', file=sys.stderr)
        return 2
    if args.check == 'peak':
        return peak()
    if args.check == 'peak-one':
        return peak_one(bool(args.benchmark_warmup))
    if args.check == 'stop-cost':
        return stop_cost(args.updates)
    return sticky_error()


if __name__ == '__main__':
    sys.exit(main())
