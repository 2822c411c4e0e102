"""DDP's own reducer on two gloo ranks (CPU): the bytes of each gradient bucket it all-reduces, step by step.

Run as `python ddp_gloo_worker.py MODEL OUT.json [BUCKET_CAP_MB]`: forks two ranks that wrap timm's MODEL in
DistributedDataParallel as train.py does (no `bucket_cap_mb` unless given, no `gradient_as_bucket_view`), run three
training steps, and record through a comm hook the dtype and bytes of every `GradBucket` buffer each step reduces.
Rank 0 writes {"steps": [[[dtype, bytes], ...] per step], "params": [[name, dtype, numel], ...]} to OUT.json.
"""
import json
import multiprocessing
import os
import sys
import tempfile

import torch
import torch.distributed as dist

WORLD_SIZE = 2
STEPS = 3
BATCH = 2


def _recording_hook(log: list):
    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        log.append((bucket.index(), str(buffer.dtype), buffer.numel() * buffer.element_size()))
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])
    return hook


def _rank(rank: int, store_path: str, model_name: str, out: str, bucket_cap_mb) -> None:
    import timm
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group('gloo', store=dist.FileStore(store_path, WORLD_SIZE), rank=rank, world_size=WORLD_SIZE)
    model = timm.create_model(model_name, num_classes=3)
    kwargs = {} if bucket_cap_mb is None else {'bucket_cap_mb': bucket_cap_mb}
    ddp = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
    log: list = []
    ddp.register_comm_hook(None, _recording_hook(log))
    size = model.pretrained_cfg.get('input_size', (3, 32, 32))
    steps = []
    for _ in range(STEPS):
        log.clear()
        ddp(torch.randn(BATCH, *size)).sum().backward()
        steps.append([[dtype, nbytes] for _, dtype, nbytes in sorted(log)])
        model.zero_grad(set_to_none=True)
    if rank == 0:
        params = [[n, str(p.dtype), p.numel()] for n, p in model.named_parameters()]
        with open(out, 'w') as f:
            json.dump(dict(steps=steps, params=params), f)
    dist.destroy_process_group()


def main(model_name: str, out: str, bucket_cap_mb=None) -> int:
    context = multiprocessing.get_context('fork')
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, 'store')
        ranks = [context.Process(target=_rank, args=(r, store, model_name, out, bucket_cap_mb))
                 for r in range(WORLD_SIZE)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(timeout=120)
        return max(abs(p.exitcode or 0) for p in ranks)


if __name__ == '__main__':
    cap = float(sys.argv[3]) if len(sys.argv) > 3 else None
    sys.exit(main(sys.argv[1], sys.argv[2], cap))
