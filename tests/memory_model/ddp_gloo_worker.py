"""DDP's own reducer on two gloo ranks (CPU): the bytes of each gradient bucket it all-reduces, step by step.

Run as `python ddp_gloo_worker.py MODEL OUT.json [CAP ...]`: forks two ranks that, for each CAP ('default': no
`bucket_cap_mb`, as train.py; else that `bucket_cap_mb`), wrap a fresh timm MODEL in DistributedDataParallel without
`gradient_as_bucket_view` (as train.py), run two training steps, and record through a comm hook the dtype and bytes
of every `GradBucket` buffer each step reduces. Rank 0 writes {CAP: [[[dtype, bytes], ...] per step]} to OUT.json.
"""
import json
import multiprocessing
import os
import sys
import tempfile

import torch
import torch.distributed as dist

WORLD_SIZE = 2
STEPS = 2  # the construction's buckets, then the rebuilt ones
BATCH = 2


def _recording_hook(log: list):
    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        log.append((bucket.index(), str(buffer.dtype), buffer.numel() * buffer.element_size()))
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])
    return hook


def _steps(model_name: str, cap: str) -> list:
    import timm
    model = timm.create_model(model_name, num_classes=3)
    kwargs = {} if cap == 'default' else {'bucket_cap_mb': float(cap)}
    ddp = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
    log: list = []
    ddp.register_comm_hook(None, _recording_hook(log))
    steps = []
    for _ in range(STEPS):
        log.clear()
        ddp(torch.randn(BATCH, *model.pretrained_cfg['input_size'])).sum().backward()
        steps.append([[dtype, nbytes] for _, dtype, nbytes in sorted(log)])
        model.zero_grad(set_to_none=True)
    return steps


def _rank(rank: int, store_path: str, model_name: str, out: str, caps: list) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group('gloo', store=dist.FileStore(store_path, WORLD_SIZE), rank=rank, world_size=WORLD_SIZE)
    recorded = {cap: _steps(model_name, cap) for cap in caps}
    if rank == 0:
        with open(out, 'w') as f:
            json.dump(recorded, f)
    dist.destroy_process_group()


def main(model_name: str, out: str, caps: list) -> int:
    context = multiprocessing.get_context('fork')
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, 'store')
        ranks = [context.Process(target=_rank, args=(r, store, model_name, out, caps)) for r in range(WORLD_SIZE)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(timeout=120)
        hung = [p for p in ranks if p.is_alive()]
        for p in hung:
            p.kill()
        return 1 if hung else max(abs(p.exitcode) for p in ranks)


if __name__ == '__main__':
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:] or ['default']))
