"""The predicted CUDA memory snapshot against the real one, on one GPU (bench/gpu_check.sh's `snapshot` part).

    python bench/snapshot_check.py [--out DIR] [--model resnet50] [--mem-budget 24GiB]

validate.py's forward (float16 AMP, cuDNN benchmark on) at the batch `validate.py --estimate` plans for the budget:
the predicted snapshot is written as `validate.py --memory-snapshot` writes it, then the same forward runs for real
with `torch.cuda.memory._record_memory_history` on, its allocator capped at the memory the plan counted on
(`set_per_process_memory_fraction`). Both snapshots are taken the same way, `_snapshot()` after the steps. Prints
side by side the peaks allocated and reserved, and the top of each trace's memory_viz timeline (the most requested
bytes alive at once, as the page stacks the alloc and free events), how many of the real trace's alloc events carry a
size that is no multiple of 512 B (requested sizes, as the predicted trace writes them), and whether the planned batch
held. Exit status 1 when the planned batch ran out of memory.
"""
import argparse
import os
import pickle
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GiB = 1 << 30


def real_snapshot(model_name: str, batch: int, fraction: float, iterations: int, path: str) -> tuple:
    """Run the forward for real and write its snapshot: (held, peak allocated, peak reserved)."""
    import timm
    import torch
    torch.backends.cudnn.benchmark = True
    torch.cuda.set_per_process_memory_fraction(fraction)
    torch.cuda.memory._record_memory_history(max_entries=200000)
    held = True
    try:
        model = timm.create_model(model_name, num_classes=1000).cuda().eval()
        x = torch.randn(batch, 3, 224, 224, device='cuda')
        with torch.no_grad(), torch.autocast('cuda', dtype=torch.float16):
            for _ in range(iterations):
                out = model(x)
                torch.cuda.synchronize()
        del out
    except torch.cuda.OutOfMemoryError:
        held = False
    with open(path, 'wb') as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)
    torch.cuda.memory._record_memory_history(enabled=None)
    return held, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def timeline_top(snapshot: dict) -> int:
    """The most bytes the trace holds at once: its alloc events' sizes less those of the free_completed events."""
    alive = top = 0
    for event in snapshot['device_traces'][0]:
        if event['action'] == 'alloc':
            alive += event['size']
            top = max(top, alive)
        elif event['action'] == 'free_completed':
            alive -= event['size']
    return top


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', default=os.path.join(ROOT, 'output', 'gpu_check'))
    parser.add_argument('--model', default='resnet50')
    parser.add_argument('--mem-budget', default='24GiB')
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from timm_ext.validate.args import parse_validate_args
    from timm_ext.validate.batch_estimate import estimate_eval_batch
    os.makedirs(args.out, exist_ok=True)
    predicted_path, real_path = os.path.join(args.out, 'predicted.pickle'), os.path.join(args.out, 'real.pickle')
    vargs = parse_validate_args(['--model', args.model, '--amp', '--device', 'cuda', '--mem-budget',
                                    args.mem_budget, '--estimate'])
    planned = estimate_eval_batch(vargs, args.model, 'cuda', args.mem_budget)
    replay = planned.estimate.replay
    batch, describe = planned.batch_size, planned.estimate.describe
    print('\n'.join(replay.save_snapshot(batch, planned.usable, predicted_path, describe)))
    with open(predicted_path, 'rb') as f:
        predicted = pickle.load(f)
    figures = predicted['predicted']
    fraction = min(1.0, planned.usable / torch.cuda.get_device_properties(0).total_memory)
    held, allocated, reserved = real_snapshot(args.model, batch, fraction, replay.config.iterations, real_path)
    with open(real_path, 'rb') as f:
        real = pickle.load(f)
    print(f'{"":28s} {"predicted":>12s} {"real":>12s}')
    for name, ours, theirs in (('peak allocated (GiB)', figures['peak_allocated'], allocated),
                               ('peak reserved (GiB)', figures['peak_reserved'], reserved),
                               ('timeline top (GiB)', timeline_top(predicted), timeline_top(real))):
        print(f'{name:28s} {ours / GiB:12.3f} {theirs / GiB:12.3f}')
    sizes = [e['size'] for e in real['device_traces'][0] if e['action'] == 'alloc']
    print(f'real alloc events: {len(sizes)}, {sum(size % 512 != 0 for size in sizes)} of them with a size that is no '
          f'multiple of 512 B (a requested size)')
    outcome = 'held' if held else 'ran out of memory'
    print(f'RESULT: batch {batch} in {planned.usable / GiB:.2f} GiB {outcome}; '
          f'reserved predicted {figures["peak_reserved"] / GiB:.2f} GiB, real {reserved / GiB:.2f} GiB')
    return 0 if held else 1


if __name__ == '__main__':
    sys.exit(main())
