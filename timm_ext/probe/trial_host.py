"""CPU trials for a process that cannot fork them: a fresh interpreter builds the same trial and forks each one.

A process that has run a backward pass (a notebook, a larger script) runs autograd's worker threads, and torch then
refuses autograd in every child forked after it (`timm_ext.child_process.fork_runs_autograd`). Trials run in that
process instead would measure its history, not the step: its free heap serves the step's blocks without the data
segment growing (test_resnet at 64 px, batch 16: 17 MB there, 28 MB in a fresh process), so the chosen batch need
not hold in the train.py that follows. A trial host is a new interpreter with no such history: it rebuilds the trial
from train.py's arguments (`TrainTrialSetup.args`) and forks each trial under the same cap, exactly as a fresh
tune_batch.py does. It costs one interpreter start and one build, paid only by such a process.
"""
import argparse
import contextlib
import dataclasses
import importlib
import logging
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable, Iterator, List, Optional

import timm
import torch

from ..memory import PeakMeter, memory_cap
from ..child_process import die_with_parent, fork_runs_autograd, soft_limit_lifted
from .measure import measured_trial
from .table import Trial, TrialFn
from .trial import TrainTrialSetup, build_train_trial

__all__ = ['TrialHost', 'hosted_trials', 'serve', 'uncapped_trial']

_logger = logging.getLogger(__name__)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class _HostSpec:
    """What the host needs to build the caller's trial: train.py's arguments, the setup's own settings, and where
    the caller's models come from (a model registered by the caller's module is imported by name)."""
    args: argparse.Namespace
    phase: str
    eval_samples: Optional[int]
    train_batch: Optional[int]
    sys_path: List[str]
    model_module: Optional[str]
    mkldnn: bool

    def build(self) -> TrainTrialSetup:
        sys.path[:0] = [p for p in self.sys_path if p not in sys.path]
        if self.model_module:
            importlib.import_module(self.model_module)
        torch.backends.mkldnn.enabled = self.mkldnn
        setup = dataclasses.replace(build_train_trial(self.args, torch.device('cpu')), eval_samples=self.eval_samples)
        return setup.eval_trials(self.train_batch) if self.phase == 'eval' else setup


def _host_spec(setup: TrainTrialSetup) -> Optional[_HostSpec]:
    """The setup as the host can build it, or None (not built by `build_train_trial`, a model the host cannot
    import, arguments that cannot be sent)."""
    if setup.args is None:
        return None
    try:
        model_module = timm.models.model_entrypoint(timm.models.get_arch_name(setup.args.model)).__module__
    except (KeyError, RuntimeError, ValueError):  # not a registered name (a hub model): the host resolves it too
        model_module = None
    if model_module == '__main__':  # a model defined in a script or notebook cell: nothing to import it from
        return None
    spec = _HostSpec(setup.args, setup.phase, setup.eval_samples, setup.train_batch,
                     [os.path.abspath(p) for p in sys.path], model_module, torch.backends.mkldnn.enabled)
    try:
        pickle.dumps(spec)
    except (pickle.PicklingError, TypeError, AttributeError):
        return None
    return spec


class TrialHost:
    """A fresh interpreter that runs the probe's CPU trials of one setup, each in a fork of its own.

    Args:
        spec: The caller's trial setup as the host builds it again (`_host_spec`).

    Raises:
        RuntimeError: The host could not build the setup (the message is the host's one line).
    """

    def __init__(self, spec: _HostSpec):
        host_read, parent_write = os.pipe()
        parent_read, host_write = os.pipe()
        env = {**os.environ, 'PYTHONPATH': os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get('PYTHONPATH')]))}
        self._process = subprocess.Popen(
            [sys.executable, '-m', 'timm_ext.probe.trial_host', str(host_read), str(host_write), str(os.getpid())],
            pass_fds=(host_read, host_write), env=env)
        os.close(host_read)
        os.close(host_write)
        self._requests = Connection(parent_write, readable=False)
        self._replies = Connection(parent_read, writable=False)
        try:
            self._requests.send(spec)
            status, message = self._receive()
        except BaseException:
            self.close()
            raise
        if status != 'ready':
            self.close()
            raise RuntimeError(message)

    def _receive(self):
        try:
            return self._replies.recv()
        except EOFError:
            raise RuntimeError(f'the trial host exited with status {self._process.wait()}') from None

    def trial(self, budget: Optional[int], timed_steps: int = 1, warm_up: bool = False,
              batch_dynamic: bool = True) -> TrialFn:
        """Trials measured in the host: under a cap of `budget` bytes above the host's own memory (as
        `measured_trial` under `memory_cap`), or, with no budget, the uncapped check of `uncapped_trial` (its
        `warm_up` and `batch_dynamic` as there)."""
        def run(batch_size: int) -> Trial:
            self._requests.send((batch_size, budget, timed_steps, warm_up, batch_dynamic))
            return Trial.from_dict(self._receive())
        return run

    def close(self) -> None:
        """Stop the host (its trial forks die with it)."""
        for connection in (self._requests, self._replies):
            connection.close()
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()

@contextlib.contextmanager
def hosted_trials(setup: TrainTrialSetup) -> Iterator[Optional[TrialHost]]:
    """A trial host for the setup, stopped on exit, where its CPU trials cannot be forked from this process; None
    elsewhere (they fork here, or are not CPU trials) and where no host can build the setup (then they run in this
    process: `timm_ext.probe.forked.isolate_trials`)."""
    host = None
    if setup.device.type == 'cpu' and not fork_runs_autograd():
        spec = _host_spec(setup)
        try:
            host = TrialHost(spec) if spec is not None else None
        except RuntimeError as e:
            _logger.warning(f'No trial host could build the trial ({e}).')
        if host is not None:
            _logger.info('Probe trials run in a fresh interpreter: this process has run a backward pass, and torch '
                         'refuses autograd in processes forked after one.')
    try:
        yield host
    finally:
        if host is not None:
            host.close()


def uncapped_trial(setup: TrainTrialSetup, isolate: bool, warm_up: bool = False,
                   batch_dynamic: bool = True) -> TrialFn:
    """A trial with no cap that only says whether the step runs (`timm_ext.probe.train_probe.check_step_runs`).

    Args:
        setup: The trial.
        isolate: Run it in a fork (CPU), which lifts any memory cap this process is under.
        warm_up: Run the trial's whole warm-up (an update and the eval pass in shapes) instead of one update: every
            graph a compiled trial runs is compiled, and stays in inductor's disk cache for the trials after it.
        batch_dynamic: A compiled CPU trial keeps the batch dimension dynamic (False: static graphs, train.py's own).
    """
    def marked(run: Callable[[int], None]) -> Callable[[int], None]:
        def call(batch_size: int) -> None:
            if setup.batch_dynamic is not None:  # set where the trial runs (its fork, or this host)
                setup.batch_dynamic.enabled = batch_dynamic
            # a fork inherits the cap of a probe under way (`compiled_first` compiles between capped trials)
            with soft_limit_lifted() if isolate else contextlib.nullcontext():
                run(batch_size)
        return call

    if warm_up:
        return measured_trial(setup.step, setup.device, warmup_steps=1, timed_steps=0, before=setup.reset,
                              isolate=isolate, warmup=marked(setup.warmup))
    return measured_trial(marked(setup.step), setup.device, before=setup.reset, isolate=isolate)


def _run(setup: TrainTrialSetup, batch_size: int, budget: Optional[int], timed_steps: int, warm_up: bool,
         batch_dynamic: bool) -> Trial:
    cpu = torch.device('cpu')
    if budget is None:
        return uncapped_trial(setup, True, warm_up, batch_dynamic)(batch_size)
    with memory_cap(cpu, budget) as cap:
        return measured_trial(setup.step, cpu, PeakMeter(cpu, cap.baseline), warmup_steps=1, timed_steps=timed_steps,
                              capped=True, before=setup.reset, isolate=True, warmup=setup.warmup)(batch_size)


def serve() -> None:
    """The host's main loop (`python -m timm_ext.probe.trial_host` with the request and reply descriptors and the
    parent's pid as arguments)."""
    read_fd, write_fd, parent = map(int, sys.argv[1:4])
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides on a Ctrl-C and stops this host
    requests, replies = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    try:
        spec = requests.recv()
        try:
            setup = spec.build()
        except Exception as e:  # noqa: B902 - whatever fails, the parent gets one line and falls back
            replies.send(('error', f'{type(e).__name__}: {" ".join(str(e).split())}'[:300]))
            return
        replies.send(('ready', None))
        while True:
            replies.send(_run(setup, *requests.recv()).to_dict())
    except EOFError:  # the parent closed its end: done
        return


if __name__ == '__main__':
    serve()
