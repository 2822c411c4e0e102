"""Process-group setup and cross-rank reductions for torchrun / SLURM launched training.

timm's ``init_distributed_device`` finds the world from torchrun or SLURM variables and picks the backend from the
device (NCCL on CUDA, gloo on CPU). Two things are added here: a one-line error instead of an assert when the asked
device is not there, and the right ``device_ids`` for DDP, which must be None for a CPU module (stock passes the
CPU device and DDP refuses it, so stock dies on CPU).
"""
import argparse
from typing import List, Optional

import torch
import torch.distributed as dist
from timm.utils import init_distributed_device


class DeviceError(Exception):
    """The asked device cannot be used on this machine."""


# How gloo and NCCL word a collective that failed because another process of the group is gone.
_LOST_PEER_MARKERS = ('Connection reset by peer', 'Connection closed by peer', 'Broken pipe', 'Connection refused',
                      'NCCL communicator was aborted', 'Socket Timeout', 'ProcessGroupNCCL')


def lost_peer(e: BaseException) -> bool:
    """Whether `e` is a collective that failed because another rank died or could not be reached."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return isinstance(e, dist.DistError) or any(m in str(e) for m in _LOST_PEER_MARKERS)


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


def init_device(args: argparse.Namespace) -> torch.device:
    """Set up the device and, under torchrun or SLURM, the process group; fills args.rank/world_size/...

    Returns:
        The device this process trains on.

    Raises:
        DeviceError: The asked device type is not available.
    """
    _check_device_available(args.device)
    return init_distributed_device(args)


def ddp_device_ids(device: torch.device) -> Optional[List[torch.device]]:
    """``device_ids`` for DistributedDataParallel: the accelerator, or None for a CPU module."""
    return None if device.type == 'cpu' else [device]


def reduce_mean(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """Mean of ``tensor`` over all ranks (a copy; the input is left alone)."""
    out = tensor.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / world_size


def reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over all ranks (a copy)."""
    out = tensor.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out
