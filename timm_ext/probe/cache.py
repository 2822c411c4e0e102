"""A cache of probe results, so a second identical request costs no trials.

One JSON file per request in the user's cache folder (`$TIMM_EXT_CACHE_DIR`, else `$XDG_CACHE_HOME/timm_ext`, else
`~/.cache/timm_ext`), named by a hash of the key. The key holds everything that changes a step's memory or the
search's path: model and its kwargs, input size, precision, channels_last, gradient checkpointing, optimizer, EMA,
the eval batch, the device's name and total memory, world size, torch and timm versions, what a trial runs
(`TRIAL_FORM`), and the probe's own settings (budget, headroom, grid, start, limit). The cached trial table is
re-selected on a hit, so `--select max` and `--select critical` share an entry; a throughput request adds its
re-timing rounds and `--throughput-tol` to the key, because its table holds re-timings chosen with that tolerance.
Files are written atomically; an unreadable one (corrupted, truncated, not ours) is a warning and a miss, so the
probe runs again and replaces it.
"""
import argparse
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import timm
import torch

from ..atomic_files import DiskFullError, atomic_text
from .table import Trial

__all__ = ['cache_dir', 'probe_key', 'ProbeCache']

_logger = logging.getLogger(__name__)

# Flags of train.py that change what a training step holds in memory (besides the input size).
_MEMORY_FLAGS = (
    'model', 'model_kwargs', 'num_classes', 'in_chans', 'gp', 'drop', 'drop_path', 'drop_block', 'amp', 'amp_dtype',
    'model_dtype', 'channels_last', 'grad_checkpointing', 'opt', 'opt_kwargs', 'layer_decay', 'model_ema',
    'model_ema_force_cpu', 'torchcompile', 'torchcompile_mode', 'torchscript', 'aug_splits', 'split_bn', 'sync_bn',
    'mixup', 'cutmix', 'cutmix_minmax', 'jsd_loss', 'bce_loss', 'clip_grad', 'clip_mode', 'kd_model_name',
    'kd_distill_type', 'fast_norm', 'validation_batch_size',
)
# What a trial runs (`timm_ext.probe.trial`), so that tables of an earlier kind of trial are not reused: since the
# warm-up also runs train.py's eval pass in shapes, the same size measures a higher peak on CPU.
TRIAL_FORM = 'update, eval pass in shapes, timed updates'


def cache_dir() -> Path:
    """The folder probe results are cached in."""
    if os.environ.get('TIMM_EXT_CACHE_DIR'):
        return Path(os.environ['TIMM_EXT_CACHE_DIR'])
    base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return Path(base) / 'timm_ext'


def probe_key(args: argparse.Namespace, input_size: Sequence[int], device_name: str, device_total: int,
              world_size: int, settings: Dict[str, Any]) -> Dict[str, Any]:
    """The cache key of a probe request (a JSON-able dict).

    Args:
        args: train.py's arguments.
        input_size: (C, H, W) the trials ran at.
        device_name: The device's name (`timm_ext.memory.device_name`).
        device_total: The device's total memory in bytes.
        world_size: Number of ranks.
        settings: The probe's own settings (budget bytes, headroom, grid, start, max batch, timed steps).
    """
    key = {flag: getattr(args, flag, None) for flag in _MEMORY_FLAGS}
    key.update(input_size=list(input_size), device=device_name, device_total=device_total, world_size=world_size,
               torch=torch.__version__, timm=timm.__version__, trial=TRIAL_FORM, **settings)
    return json.loads(json.dumps(key, sort_keys=True, default=str))  # plain types only, stable order


class ProbeCache:
    """Probe results on disk, one file per key.

    Args:
        folder: Where the files live (default: `cache_dir()`).
    """

    def __init__(self, folder: Optional[os.PathLike] = None):
        self.folder = Path(folder) if folder is not None else cache_dir()

    def path(self, key: Dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return self.folder / f'probe-{digest}.json'

    def get(self, key: Dict[str, Any]) -> Optional[List[Trial]]:
        """The cached trial table for `key`, or None (no entry, an unreadable file, or a different key)."""
        path = self.path(key)
        try:
            entry = json.loads(path.read_text())
            if entry.get('key') != key:
                return None
            return [Trial.from_dict(t) for t in entry['trials']]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # torn, foreign or garbled
            _logger.warning(f'Ignoring unreadable probe cache file {path} ({type(e).__name__}: {e}); '
                            f'probing afresh')
            return None

    def put(self, key: Dict[str, Any], trials: Sequence[Trial]) -> Optional[Path]:
        """Store a finished probe's trials under `key`; returns the file written, or None when it cannot be.

        The file is replaced atomically (each writer has its own temporary name), so a reader, or a second tune_batch
        run storing the same key at the same time, never sees half a file. The cache only saves time: a failure to
        write it is a warning.
        """
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_text(json.dumps({'key': key, 'trials': [t.to_dict() for t in trials]}, indent=1), path)
        except (OSError, DiskFullError) as e:
            _logger.warning(f'Could not write the probe cache {path} ({e}); the result is not cached')
            return None
        return path
