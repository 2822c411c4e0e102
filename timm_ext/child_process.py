"""A function run in a forked child that dies with its parent, and the answer it sends back as JSON.

On CPU a process does not give memory back (glibc's heap high-water mark, oneDNN's per-shape caches), and once it has
run a backward pass its forks cannot run autograd: so the memory estimate traces in a fork of its own
(`call_uncapped`), the probe's CPU trials run in forks (`timm_ext.probe.forked`), and tune_batch.py's torchrun ranks
die with it (`die_with_parent`).
"""
import contextlib
import ctypes
import functools
import json
import os
import resource
import signal
from typing import Callable, Optional, Tuple

import torch

__all__ = ['die_with_parent', 'call_forked', 'call_uncapped', 'fork_runs_autograd', 'soft_limit_lifted']

_FORK_RUNS_AUTOGRAD = [True]  # once False, False for good: autograd's threads never stop
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (for a child, right after fork or before exec).

    A parent killed with SIGKILL runs no cleanup, so without this its trial children would run on as orphans, each
    holding memory under the probe's cap. Elsewhere than Linux this does nothing.

    Args:
        parent: The parent's pid, read before the fork: if it has already died, this process exits at once.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def call_forked(fn: Callable[[], object], threads: int = 1) -> Tuple[Optional[object], int]:
    """Run `fn` in a forked child (which dies with this process) and return its JSON-able answer and wait status.

    The answer is None when the child gave none (it died, or `fn` raised). With `threads` > 1 (this process runs
    other threads, whose GNU OpenMP pool does not survive a fork) the child computes with one thread. Interrupted
    while the child runs, this kills it before the interrupt goes on.
    """
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    # a Ctrl-C that lands inside fork's own handlers (logging's lock release) is swallowed there: hold it until after
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    pid = os.fork()
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if pid == 0:  # child: never returns
        status = 0
        try:
            die_with_parent(parent)
            os.close(read_fd)
            if threads > 1:
                torch.set_num_threads(1)
            os.write(write_fd, json.dumps(fn()).encode())
        except BaseException:  # noqa: B036 - the child must exit here whatever happens
            status = 1
        finally:
            os._exit(status)
    os.close(write_fd)
    try:
        chunks = []
        while chunk := os.read(read_fd, 65536):
            chunks.append(chunk)
        _, wait_status = os.waitpid(pid, 0)
        pid = 0
    finally:
        os.close(read_fd)
        if pid:  # interrupted while the child runs: stop it, then let the interrupt through
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return (json.loads(b''.join(chunks)) if chunks else None), wait_status


def fork_runs_autograd() -> bool:
    """Whether a child forked from this process can still run a backward pass.

    Once this process has run one (on any device, fake tensors included), torch starts autograd's thread pool and
    refuses autograd in every child forked after that ("Unable to handle autograd's threading in combination with
    fork-based multiprocessing"). A tiny backward in a throwaway fork answers it (a few milliseconds).
    """
    if _FORK_RUNS_AUTOGRAD[0]:
        def backward() -> bool:
            torch.ones(1, requires_grad=True).sum().backward()
            return True
        _FORK_RUNS_AUTOGRAD[0] = call_forked(backward, threads=2)[0] is True
    return _FORK_RUNS_AUTOGRAD[0]


def call_uncapped(fn: Callable[..., object], *args: object) -> Optional[object]:
    """`fn(*args)`'s JSON-able answer, computed with RLIMIT_DATA's soft limit lifted to the hard one: in a forked
    child (one thread) where a fork can run autograd, else in this process, the limit restored after (None: the child
    died without an answer)."""
    if fork_runs_autograd():
        return call_forked(functools.partial(_single_threaded_uncapped, fn, *args), threads=2)[0]
    with soft_limit_lifted():
        return json.loads(json.dumps(fn(*args)))  # the answer a child gives: JSON's types, nothing shared


@contextlib.contextmanager
def soft_limit_lifted():
    """RLIMIT_DATA's soft limit lifted to the hard one while the block runs (a fork of a capped process that must
    run uncapped), restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _single_threaded_uncapped(fn: Callable[..., object], *args: object) -> object:
    torch.set_num_threads(1)  # a fork of a threaded process must: GNU OpenMP's pool does not survive it
    with soft_limit_lifted():
        return fn(*args)
