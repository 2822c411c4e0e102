"""A probe trial run in a forked child: a fresh heap for every CPU trial (`run_forked`), where the process can still
fork one (`isolate_trials`); the process helpers are `timm_ext.child_process`'s.
"""
import logging
import os
import signal
from typing import Callable

import torch

from ..child_process import call_forked, fork_runs_autograd
from .table import ERROR, OOM, Trial

__all__ = ['isolate_trials', 'run_forked']

_logger = logging.getLogger(__name__)

# The signals a trial process dies of when an allocation fails under the cap (see `run_forked`)
CAPPED_KILLS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGKILL, signal.SIGABRT)

_SINGLE_THREAD_NOTE = [False]
_IN_PROCESS_NOTE = [False]


def isolate_trials(device: torch.device) -> bool:
    """Whether the probe's trials on `device` run in forks of this process (`run_forked`).

    CPU trials do, where a fork can still run autograd. A caller that has run a backward pass before (a notebook,
    a larger script) cannot fork them: the probe then runs them in a fresh interpreter
    (`timm_ext.probe.trial_host`), and only a trial no other process can build runs in this one, its peaks
    depending on what this process did before (its free heap serves part of the step's blocks).
    """
    if device.type != 'cpu':
        return False
    if fork_runs_autograd():
        return True
    if not _IN_PROCESS_NOTE[0]:
        _IN_PROCESS_NOTE[0] = True
        _logger.warning('Probe trials run in this process: it has run a backward pass, which forked trials cannot '
                        'follow, and no fresh interpreter can build its trial; their peaks depend on what it did '
                        'before (probe from a fresh process to be sure).')
    return False


def run_forked(trial_fn: Callable[[], Trial], batch_size: int, capped: bool) -> Trial:
    """Run `trial_fn` in a forked child process and return its trial (Linux CPU trials).

    Why: on CPU a process does not give memory back between trials. glibc keeps its heap high-water mark and
    oneDNN caches the primitives (with their buffers) of every shape it has run, so under RLIMIT_DATA each trial
    would pay for the ones before it. A fork starts every trial from the same state, exactly as a fresh process
    would, and the rlimit is inherited. oneDNN also does not check every allocation: under a cap a child can die of
    SIGSEGV/SIGBUS, or of SIGABRT where a failed allocation ends in an abort (a compiled trial of test_vit under
    140 MiB: "Fatal Python error: Cannot recover from stack overflow" while dynamo handled a MemoryError). That is
    reported as out-of-memory when capped (the training probe also runs the step uncapped, so a step that crashes
    anyway is reported as the run's failure), never as a crash of the caller.

    GNU OpenMP's thread pool does not survive fork; if this process already runs other threads, the child computes
    with one thread.
    """
    threads = len(os.listdir('/proc/self/task'))
    reply, wait_status = call_forked(lambda: trial_fn().to_dict(), threads)
    if threads > 1 and not _SINGLE_THREAD_NOTE[0]:
        _SINGLE_THREAD_NOTE[0] = True
        _logger.info('Probe trials run in forked processes with 1 CPU thread (this process already runs threads).')
    if reply is not None:
        return Trial.from_dict(reply)
    if os.WIFSIGNALED(wait_status):
        sig = signal.Signals(os.WTERMSIG(wait_status)).name
        if capped and os.WTERMSIG(wait_status) in CAPPED_KILLS:
            return Trial(batch_size, OOM, error=f'trial process killed by {sig} under the memory cap')
        return Trial(batch_size, ERROR, error=f'trial process killed by {sig}')
    return Trial(batch_size, ERROR, error=f'trial process exited with status {os.WEXITSTATUS(wait_status)}')
