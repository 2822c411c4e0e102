"""Crash-safe file writes: a temporary name in the final folder, fsync, then `os.replace` onto the real name.

A process killed at any moment leaves each file written this way absent, the previous complete version, or the new
complete version; a full disk is one `DiskFullError` naming the folder and the bytes needed, and the file keeps its
previous content. Checkpoints (`timm_ext.train.checkpoint`), results files, the probe cache and the tuned config all
write through here.
"""
import csv
import errno
import io
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from .errors import TimmExtError

__all__ = [
    'TMP_SUFFIX', 'DiskFullError', 'state_bytes', 'atomic_write', 'atomic_torch_save', 'atomic_text',
    'append_csv_row', 'atomic_duplicate', 'remove_stale_tmp_files',
]

TMP_SUFFIX = '.tmp'


class DiskFullError(TimmExtError):
    """A file could not be written for lack of space; the files already there are untouched."""

    def __init__(self, path: Path, needed: Optional[int]):
        free = shutil.disk_usage(path.parent).free
        size = f'about {needed:,} bytes' if needed is not None else 'more space'
        super().__init__(f'no space left in {path.parent}: writing {path.name} needs {size}, {free:,} bytes are free; '
                         f'the files already there are intact (free some space and resume from the newest)')
        self.path = path
        self.needed = needed


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) checkpoint: close to its size on disk, for messages."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open a folder; the rename itself is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_path(path: Path) -> Path:
    # hidden and not ending in a checkpoint extension, so globbing for checkpoints never picks up a partial file
    return path.with_name(f'.{path.name}.{os.getpid()}{TMP_SUFFIX}')


def atomic_write(path: os.PathLike, write_fn: Callable[[Path], None], size: Optional[int] = None) -> None:
    """Write a file by calling ``write_fn(tmp_path)``, then fsync and rename it onto ``path``.

    Args:
        path: Final file name.
        write_fn: Writes the complete content to the temporary path it is given.
        size: About how many bytes the file takes, for the message when the disk is full.

    Raises:
        DiskFullError: The file system has no room for it (``path`` keeps its previous content).
    """
    path = Path(path)
    tmp = _tmp_path(path)
    try:
        write_fn(tmp)
        with open(tmp, 'rb+') as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        if _is_disk_full(e, tmp, size):
            raise DiskFullError(path, size) from None
        raise
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def _is_disk_full(e: Optional[BaseException], tmp: Path, size: Optional[int]) -> bool:
    """Whether a failed write ran out of space.

    Python's own writes say so (ENOSPC), but torch.save's zip writer only reports 'iostream error' / 'unexpected
    pos' without the errno; then the free space decides: less than the file needs beyond what it wrote so far.
    """
    cause = e
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in _DISK_FULL:
            return True
        cause = cause.__cause__ or cause.__context__
    if size is None or not isinstance(e, RuntimeError):
        return False
    written = tmp.stat().st_size if tmp.exists() else 0
    return shutil.disk_usage(tmp.parent).free < size - written


def atomic_torch_save(obj: Any, path: os.PathLike) -> None:
    """``torch.save`` made crash safe with :func:`atomic_write`."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp), size=state_bytes(obj))


def atomic_text(text: str, path: os.PathLike) -> None:
    """Write a text file crash safe with :func:`atomic_write`."""
    atomic_write(path, lambda tmp: tmp.write_text(text), size=len(text.encode()))


def append_csv_row(path: os.PathLike, row: Dict[str, Any]) -> None:
    """Add a row to a csv file (a header first when the file is new or empty), replacing the file atomically.

    Stock appends in place, so a full disk or a kill can leave a torn last row; here the file is whole or as before.
    """
    path = Path(path)
    old = path.read_text() if path.exists() else ''
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(row))
    if not old:
        writer.writeheader()
    writer.writerow(row)
    atomic_text(old + out.getvalue(), path)


def atomic_duplicate(src: os.PathLike, dst: os.PathLike) -> None:
    """Make ``dst`` a complete copy of ``src`` (a hard link where possible), replacing ``dst`` atomically."""
    src = Path(src)

    def link_or_copy(tmp: Path) -> None:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)

    atomic_write(dst, link_or_copy, size=src.stat().st_size)


def remove_stale_tmp_files(folder: os.PathLike) -> List[Path]:
    """Delete temporary files a killed run left in ``folder``; returns what was removed."""
    stale = sorted(Path(folder).glob(f'.*{TMP_SUFFIX}'))
    for p in stale:
        p.unlink(missing_ok=True)
    return stale
