"""Hand the device over from the probe to the training it planned: this process becomes the training command.

A probe that launched training as a child would keep its model, EMA copy, optimizer and CUDA context alive, and its
caching allocator would keep the blocks of the last trial (or of the critical-batch warm-up) reserved, so the child
could run out of memory at the very micro-batch just planned. `exec_training` replaces the process image instead
(`os.execv`, same PID): nothing of the probe survives, and the training sees the device as a fresh process would.
Signals, the exit status and the terminal go straight to the training, as if it had been started by hand.

Two things would survive `execv`: a file descriptor not marked close-on-exec (the GPU driver's device files, on
which its memory and context hang, are left to the driver to mark: `close_device_files_on_exec` marks them all), and
child processes such as DataLoader workers (`end_child_processes` ends them).

When tune_batch.py trains in its own process instead, `release_probe` lets go of what the probe left first.
"""
import gc
import logging
import multiprocessing
import os
import subprocess
import sys
from typing import Sequence, Tuple

import torch

from ..errors import TimmExtError
from ..memory import free_memory

__all__ = ['DEVICE_FILE_PREFIXES', 'HandoverError', 'close_device_files_on_exec', 'end_child_processes',
           'exec_training', 'release_probe']

# NVIDIA's driver files, and AMD/Intel GPU compute and render nodes
DEVICE_FILE_PREFIXES = ('/dev/nvidia', '/dev/kfd', '/dev/dri/')


class HandoverError(TimmExtError):
    """The training command could not be started; the message is one line."""


def release_probe(device: torch.device, compiled: bool) -> None:
    """Release what the probe left before training starts in this process, in the order that frees it all: dynamo's
    caches first (its compiled graphs would also count toward the recompile limit of the same code), then the garbage
    that leaves (reference cycles only `gc` breaks), then the caching allocator's blocks and peak stats
    (`free_memory`): blocks still referenced when the cache is emptied stay reserved."""
    if compiled:
        torch._dynamo.reset()
    gc.collect()
    free_memory(device)


def close_device_files_on_exec(prefixes: Tuple[str, ...] = DEVICE_FILE_PREFIXES) -> int:
    """Mark every open file descriptor on a path starting with one of `prefixes` close-on-exec (Linux /proc).

    Marking, not closing: the driver's own threads may still use them until the exec.

    Returns:
        How many descriptors matched.
    """
    fd_dir = '/proc/self/fd'
    if not os.path.isdir(fd_dir):
        return 0
    marked = 0
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, name))
            if target.startswith(prefixes):
                os.set_inheritable(int(name), False)
                marked += 1
        except OSError:  # the listing's own descriptor, or one closed meanwhile
            continue
    return marked


def end_child_processes(timeout: float = 5.0) -> int:
    """Terminate this process's multiprocessing children (a persistent DataLoader's workers, say) and wait for them.

    They would outlive the exec: same parent PID, so they never notice, waiting on queues nobody reads any more.

    Returns:
        How many were still running.
    """
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout)
    return len(children)


def exec_training(command: Sequence[str]) -> int:
    """Become `command` (an absolute executable path first): flush output, release the device, `os.execv`.

    Returns only where exec is not the POSIX one (then the command runs as a child and its status is returned).

    Raises:
        HandoverError: The command cannot be executed.
    """
    if os.name != 'posix':
        return subprocess.call(list(command))
    gc.collect()  # finalizers first: a loader's iterator shuts its workers down itself
    end_child_processes()
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    close_device_files_on_exec()
    try:
        os.execv(command[0], list(command))
    except OSError as e:
        raise HandoverError(f'cannot start {command[0]}: {e.strerror}') from None
    return 0  # not reached: execv does not return
