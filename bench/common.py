"""What the loop benchmarks share: their command line, device sync, and the synthetic batches they train on."""
import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Tuple

import torch


def loop_bench_parser(description: str, batches: int, accum: int, repeats: int, output: str) -> argparse.ArgumentParser:
    """The options of a training-loop benchmark, with that benchmark's defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument('--model', default='resnet18')
    parser.add_argument('-b', '--batch-size', type=int, default=32)
    parser.add_argument('--img-size', type=int, default=64)
    parser.add_argument('--batches', type=int, default=batches, help='micro-batches per timed epoch')
    parser.add_argument('--accum', type=int, default=accum, help='gradient accumulation steps')
    parser.add_argument('--repeats', type=int, default=repeats, help='timed epochs per loop (after one warm-up each)')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--threads', type=int, default=1, help='torch intra-op threads on CPU')
    parser.add_argument('--output', default=output)
    return parser


def start_loop_bench(parser: argparse.ArgumentParser) -> Tuple[argparse.Namespace, torch.device]:
    """Parse a loop benchmark's options, set its threads and quiet the loop's log lines (not part of the measure)."""
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    return args, torch.device(args.device)


def sync(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock timings cover it."""
    if device.type == 'cuda':
        torch.cuda.synchronize()


def timed_epoch(loop, epoch: int, batches, device: torch.device) -> float:
    """Wall seconds of one `TrainLoop` epoch over `batches`, queued device work included."""
    sync(device)
    start = time.perf_counter()
    loop.train_one_epoch(epoch, batches)
    sync(device)
    return time.perf_counter() - start


def synthetic_batches(args: argparse.Namespace, device: torch.device) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """`args.batches` random image batches with 10-class targets, already on `device`."""
    return [(torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=device),
             torch.randint(0, 10, (args.batch_size,), device=device)) for _ in range(args.batches)]


def write_result(path: str, result: dict) -> None:
    """Save a benchmark's figures as JSON, creating the folder."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


def run_json_worker(script: str, argv: tuple, repo: Path, timeout: float = 900) -> dict:
    """Run `script --worker ARGV` in a fresh interpreter (one thread) and return the JSON its last line prints."""
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(repo)}
    done = subprocess.run([sys.executable, script, '--worker', json.dumps(argv)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f'worker {argv[0]} failed: {done.stderr[-2000:]}')
    return json.loads(done.stdout.strip().splitlines()[-1])
