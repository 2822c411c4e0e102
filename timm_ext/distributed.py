"""Process-group setup and cross-rank reductions for torchrun / SLURM launched training.

timm's ``init_distributed_device`` finds the world from torchrun or SLURM variables and picks the backend from the
device (NCCL on CUDA, gloo on CPU). Added here: a one-line error instead of an assert or a CUDA traceback when the
asked device is not there (no CUDA, or a CUDA index beyond ``torch.cuda.device_count()``, including a local rank
beyond it when torchrun starts more processes than the node has GPUs), and the right ``device_ids`` for DDP, which
must be None for a CPU module (stock passes the CPU device and DDP refuses it, so stock dies on CPU), a group timeout
users set (`--dist-timeout`: every wait on a peer is bounded, `timm_ext.peer_wait`), a teardown that waits (bounded)
for every rank before the group goes, and a process exit that cannot abort in gloo's threads (`exit_process`).
"""
import argparse
import atexit
import datetime
import os
import sys
from typing import List, NoReturn, Optional, Tuple

import torch
import torch.distributed as dist
from timm.utils import init_distributed_device
from timm.utils.distributed import is_distributed_env, world_info_from_env

from .errors import TimmExtError
from .memory import steady_cpu_heap
from .oom import cpu_data_capped
from .peer_wait import group_timeout_s, lost_peer, peer_wait  # noqa: F401 - lost_peer: train.py imports it from here


class DeviceError(TimmExtError):
    """The asked device cannot be used on this machine."""


def _check_device_available(device: str) -> None:
    device_type = device.split(':', 1)[0]
    if device_type == 'cuda' and not torch.cuda.is_available():
        raise DeviceError(f'--device {device}: CUDA is not available on this machine; pass --device cpu')
    if device_type == 'mps' and not torch.backends.mps.is_available():
        raise DeviceError(f'--device {device}: MPS is not available on this machine; pass --device cpu')
    if device_type not in ('cpu', 'cuda', 'mps', 'meta'):
        module = getattr(torch, device_type, None)
        if module is None or not hasattr(module, 'is_available') or not module.is_available():
            raise DeviceError(f'--device {device}: no {device_type} device here (is its --device-modules '
                              f'package installed?); pass --device cpu or cuda')


def check_cuda_index(device: str, local_rank: Optional[int] = None) -> None:
    """Refuse a CUDA device index this machine does not have, before anything touches CUDA.

    Args:
        device: The --device value.
        local_rank: Under torchrun or SLURM timm trains each process on the device of its local rank, whatever index
            was given, so that is what must exist then (None: not distributed, the index in `device` counts).

    Raises:
        DeviceError: The index is not a CUDA device here (or `device` is not a device name at all).
    """
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise DeviceError(f'--device {device}: not a device name; use e.g. cuda, cuda:1 or cpu') from None
    if parsed.type != 'cuda':
        return
    count = torch.cuda.device_count()
    if local_rank is not None:
        if local_rank >= count:
            raise DeviceError(f'--device {device}: local rank {local_rank} trains on CUDA device {local_rank}, but '
                              f'torch.cuda.device_count() is {count}; start at most {count} processes per node')
    elif parsed.index is not None and parsed.index >= count:
        raise DeviceError(f'--device {device}: there is no CUDA device {parsed.index}, torch.cuda.device_count() is '
                          f'{count}; pass an index below {count} (or cuda for the first)')


def check_device(device: str, local_rank: Optional[int] = None) -> None:
    """Refuse a device this machine does not have: the type (`--device-modules` loaded first) and a CUDA index.

    Raises:
        DeviceError: One line saying what is missing.
    """
    _check_device_available(device)
    check_cuda_index(device, local_rank)


def init_device(args: argparse.Namespace,
                default_timeout_s: Optional[float] = None) -> Tuple[argparse.Namespace, torch.device]:
    """Set up the device and, under torchrun or SLURM, the process group.

    Args:
        args: train.py's namespace; its ``dist_timeout`` (``--dist-timeout``, seconds) bounds every collective of the
            group, a wait on a stalled peer included.
        default_timeout_s: The timeout where ``--dist-timeout`` is not given (None: the backend's, as stock: 30 min
            for gloo, 10 for NCCL).

    Returns:
        A copy of `args` with the runtime fields timm's ``init_distributed_device`` fills in (``device``,
        ``distributed``, ``world_size``, ``rank``, ``local_rank``), and the device this process trains on. `args`
        itself is left as parsed, so a caller can still write the config it describes.

    Raises:
        DeviceError: The asked device type is not available, or its CUDA index does not exist.
    """
    check_device(args.device, world_info_from_env()[0] if is_distributed_env() else None)
    args = argparse.Namespace(**vars(args))
    device = init_distributed_device(args)
    timeout_s = getattr(args, 'dist_timeout', None) or default_timeout_s
    if args.distributed and timeout_s:
        dist.set_timeout(datetime.timedelta(seconds=timeout_s))  # timm's init takes none: set on the group it made
    if device.type == 'cpu' and (getattr(args, 'steady_cpu_heap', False) or cpu_data_capped()):
        steady_cpu_heap()  # a run tuned under a budget must peak as its probe's trials did; else stock's speed
    return args, device


def end_process_group(wait: bool = True, timeout: Optional[float] = None) -> None:
    """Destroy the default process group (if any), first waiting up to `timeout` seconds for every rank to get here.

    Why the wait: a finished rank that leaves while a peer still works makes that peer's next collective fail. A rank
    that ends on an error passes `wait=False`: its peers may never arrive, and the destroy alone is then the right end.
    Why always destroy, on errors too: a group still alive when the interpreter finalizes can have a gloo worker
    thread drop the last reference to a Python tensor there; the thread is killed on the GIL and the process aborts
    ("terminate called without an active exception"). Destroyed while Python runs, the backend joins its threads.

    Args:
        wait: Wait for every rank first (a bounded barrier).
        timeout: Seconds the barrier may take (default: the group's timeout, at most 60 s: every rank that finished
            gets here within moments of the others).
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    if wait:
        seconds = timeout or min(group_timeout_s() or 60.0, 60.0)
        try:
            if dist.get_backend() == 'gloo':  # gloo's barrier can be bounded; a late peer is an error, not a hang
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=seconds))
            else:
                dist.barrier()
        except RuntimeError as e:  # a peer died or is late: still destroy, and say so
            print(f'warning: rank {dist.get_rank()} ended without the other ranks: {" ".join(str(e).split())[:160]}',
                  file=sys.stderr)
    dist.destroy_process_group()


def gloo_threads_alive() -> bool:
    """Whether gloo's worker threads still run in this process (Linux; False elsewhere).

    After `end_process_group` they run on only where something still holds the backend: DistributedDataParallel
    does, through a reference cycle the garbage collector cannot see (its reducer, in C++).
    """
    try:
        tasks = os.listdir('/proc/self/task')
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f'/proc/self/task/{task}/comm') as f:
                if f.read().startswith(('pt_gloo_runloop', 'gloo_tcp_loop')):
                    return True
        except OSError:  # the thread ended meanwhile
            continue
    return False


def exit_process(status: int) -> NoReturn:
    """End a script's process with `status`: the group ended (without waiting), exit handlers run, streams flushed,
    then, where gloo's threads still run, `os._exit`, so that the interpreter never finalizes around them.

    Why: a gloo worker thread that drops the last reference to a Python tensor (a collective's input, released just
    after the collective returned) while the interpreter finalizes is killed on the GIL, and the forced unwind through
    gloo's loop aborts the process ("terminate called without an active exception"), a rank that had finished well.
    `end_process_group` joins the threads where nothing else holds the backend; DDP's model holds it to the end.
    """
    end_process_group(wait=False)
    if gloo_threads_alive():
        atexit._run_exitfuncs()  # what a normal exit runs before finalizing (logging's flush among them)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or broken: nothing more can be said on it
                pass
        os._exit(status)
    sys.exit(status)


def ddp_device_ids(device: torch.device) -> Optional[List[torch.device]]:
    """``device_ids`` for DistributedDataParallel: the accelerator, or None for a CPU module."""
    return None if device.type == 'cpu' else [device]


def reduce_mean(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """Mean of ``tensor`` over all ranks (a copy; the input is left alone)."""
    out = tensor.detach().clone()
    with peer_wait('a mean over ranks (the loss or a metric)'):
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / world_size


def reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over all ranks (a copy)."""
    out = tensor.detach().clone()
    with peer_wait('a sum over ranks (samples or metric totals)'):
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out
