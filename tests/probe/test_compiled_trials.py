"""Compiled CPU trials that share one compile (`timm_ext.probe.compiled_trials`): the batch dimension marked dynamic,
the graphs found by forked siblings in inductor's disk cache, what a trial spent compiling in its record and in the
plan's Spent line."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from conftest import REPO_ROOT
from timm_ext.probe.compiled_trials import (BatchDynamic, CompileCounts, compile_counts, compiled_first,
                                            counting_compiles, graph_cache_on)
from timm_ext.oom import is_oom
from timm_ext.probe.forked import run_forked
from timm_ext.probe.table import Trial, format_trial
from timm_ext.probe.trial import build_train_trial
from timm_ext.probe.trial_host import uncapped_trial
from timm_ext.train.args import parse_args
from timm_ext.tune.tuner import Spent

CPU = torch.device('cpu')


class Task(nn.Module):
    """A task with a compiled train module and a compiled eval module, as timm's tasks hold them."""

    def __init__(self, backend):
        super().__init__()
        self.trainable_module = torch.compile(nn.Linear(4, 2), backend=backend)
        self.eval_model = torch.compile(nn.Linear(4, 2), backend=backend)


def counting_backend():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend, graphs


def test_a_marked_batch_dimension_makes_one_graph_serve_every_batch_size():
    """torch/_dynamo/decorators.py maybe_mark_dynamic: a dimension marked before dynamo sees the input is traced
    symbolic, so later sizes pass the graph's guards; unmarked, dynamo traces the first size static and recompiles
    at the second (automatic dynamic shapes)."""
    torch._dynamo.reset()
    backend, graphs = counting_backend()
    task = Task(backend)
    marks = BatchDynamic(task)
    assert len(marks.modules) == 2
    with torch.no_grad():
        for rows in (3, 5, 9):
            task.trainable_module(torch.randn(rows, 4))
    assert len(graphs) == 1

    torch._dynamo.reset()
    backend, graphs = counting_backend()
    task = Task(backend)
    BatchDynamic(task).enabled = False
    with torch.no_grad():
        for rows in (3, 5):
            task.trainable_module(torch.randn(rows, 4))
    assert len(graphs) == 2, 'unmarked: a static graph for the first size, then a recompile'


def test_compile_counts_say_nothing_when_nothing_was_compiled():
    before = CompileCounts(1.0, 2, 3)
    assert CompileCounts(1.0, 2, 3).since(before) is None
    assert CompileCounts(2.5, 2, 5).since(before) == CompileCounts(1.5, 0, 2)
    assert compile_counts().since(compile_counts()) is None


def test_a_trial_that_compiled_says_how_long_dynamo_took():
    """torch/_dynamo/convert_frame.py `_compile`: every frame compile is timed as '_compile.compile_inner' in
    `torch._dynamo.utils.compilation_time_metrics` (a graph loaded from the cache is too)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2 + 1, backend='eager')
    assert counting_compiles(lambda b: (compiled(torch.ones(b)), Trial(b, 'fit'))[1])(3).compile_s > 0
    assert counting_compiles(lambda b: Trial(b, 'fit'))(3).compile_s is None


def test_the_graph_cache_is_read_from_inductors_own_switches():
    """torch/_inductor/compile_fx.py fx_codegen_and_compile: the local FX graph cache is used when
    `config.fx_graph_cache` is on and `config.force_disable_caches` off (torch.compiler.config's alias)."""
    from torch._inductor import config
    with config.patch(fx_graph_cache=True, force_disable_caches=False):
        assert graph_cache_on()
    with config.patch(fx_graph_cache=False):
        assert not graph_cache_on()
    with config.patch(fx_graph_cache=True, force_disable_caches=True):
        assert not graph_cache_on()


def trial_args(*extra: str):
    args, _ = parse_args(['--model', 'test_resnet', '--num-classes', '3', '--img-size', '32', '--device', 'cpu',
                          *extra])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    return args


def test_a_compiled_cpu_trial_marks_its_batch_dimension_and_says_so():
    setup = build_train_trial(trial_args('--torchcompile'), CPU)  # torch.compile wraps lazily: nothing compiles
    assert setup.batch_dynamic is not None and setup.batch_dynamic.modules
    assert 'batch dimension dynamic in trials' in setup.describe
    assert setup.eval_trials(4).batch_dynamic is setup.batch_dynamic
    assert build_train_trial(trial_args(), CPU).batch_dynamic is None
    from torch._inductor import config
    with config.patch(fx_graph_cache=False):  # no cache to share: the trials compile their own static graphs
        assert build_train_trial(trial_args('--torchcompile'), CPU).batch_dynamic is None


def test_the_run_graphs_check_turns_the_marks_off_where_it_runs():
    seen = []

    class Setup:
        device, batch_dynamic = CPU, BatchDynamic(nn.Module())

        def step(self, batch_size):
            seen.append(('step', self.batch_dynamic.enabled))

        def warmup(self, batch_size):
            seen.append(('warmup', self.batch_dynamic.enabled))

        def reset(self):
            pass

    setup = Setup()
    assert uncapped_trial(setup, isolate=False, warm_up=True, batch_dynamic=False)(2).fits
    assert seen == [('warmup', False)], 'the whole warm-up, static, and no timed step'
    seen.clear()
    uncapped_trial(setup, isolate=False)(2)
    assert seen == [('step', True)]


def test_a_trial_that_compiled_under_the_cap_runs_again_once_an_uncapped_run_compiled():
    calls, seconds = [], []
    cache = set()

    def capped(batch_size):  # compiles the graphs of its size's range when the cache lacks them
        calls.append(('capped', batch_size))
        compiled = int(batch_size // 100 not in cache)
        if batch_size == 250:
            return Trial(batch_size, 'oom', error='killed')  # died before it could say what it compiled
        cache.add(batch_size // 100)
        return Trial(batch_size, 'fit', peak_bytes=batch_size, graphs_compiled=compiled, graphs_loaded=1 - compiled)

    def uncapped(batch_size):
        calls.append(('uncapped', batch_size))
        cache.add(batch_size // 100)
        return Trial(batch_size, 'error', error='boom') if batch_size == 399 else Trial(batch_size, 'fit')

    trial = compiled_first(capped, uncapped, seconds)
    assert trial(8).graphs_compiled == 0 and calls == [('uncapped', 8), ('capped', 8)], 'nothing compiled yet'
    calls.clear()
    assert trial(16).graphs_compiled == 0 and trial(8).fits
    assert calls == [('capped', 16), ('capped', 8)], 'in a range already compiled: one run; a size again: one run'
    calls.clear()
    assert trial(120).graphs_compiled == 0, 'the kept trial loaded what its first run compiled'
    assert calls == [('capped', 120), ('uncapped', 120), ('capped', 120)]
    calls.clear()
    trial(250)
    assert calls == [('capped', 250), ('uncapped', 250), ('capped', 250)], 'a trial that died says nothing'
    assert len(seconds) == 3
    assert trial(399).error == 'boom', 'a step that fails uncapped is the run\'s own failure'


def test_a_thread_that_cannot_start_under_the_cap_is_an_oom():
    """Measured here: test_vit's compiled trial at batch 300 under a 140 MiB cap failed in the autograd engine's
    `run_backward` (torch/csrc/autograd/engine.cpp starts its worker threads at the first backward) with
    std::system_error's EAGAIN, "Resource temporarily unavailable": pthread_create maps the thread's stack privately,
    which RLIMIT_DATA counts (man 2 setrlimit, since Linux 4.7). Uncapped, EAGAIN is not memory."""
    error = RuntimeError('Resource temporarily unavailable')
    assert is_oom(error, cpu_capped=True)
    assert not is_oom(error, cpu_capped=False)


@pytest.mark.skipif(sys.platform != 'linux', reason='forked trials are Linux')
def test_a_capped_trial_process_that_aborts_ran_out_of_memory():
    """Measured here: test_vit's compiled trial at batch 300 under 140 MiB aborted ("Fatal Python error:
    _Py_CheckRecursiveCall: Cannot recover from stack overflow", SIGABRT) while dynamo handled a MemoryError; the
    probe stopped as if the step could not run at all. Uncapped, an abort is the run's own failure."""
    assert run_forked(os.abort, 300, capped=True).status == 'oom'
    assert run_forked(os.abort, 300, capped=False).status == 'error'


def test_a_trial_line_says_what_it_compiled_and_loaded():
    trial = Trial(8, 'fit', peak_bytes=2 ** 20, ms_per_step=10.0, samples_per_s=800.0, accepted=True,
                  compile_s=3.25, graphs_compiled=0, graphs_loaded=3)
    assert format_trial(trial).endswith('[compile 3.2 s: 0 graphs compiled, 3 loaded]')
    assert 'compile' not in format_trial(Trial(8, 'fit', peak_bytes=2 ** 20, accepted=True))
    assert Trial.from_dict(trial.to_dict()) == trial


def test_compile_seconds_are_their_own_part_of_the_spent_line_and_not_judging():
    spent = Spent()
    assert 'compile' not in spent.line(), 'an eager run says nothing of compiling'
    with spent.judging():
        spent.seconds['compile'] = spent.seconds.get('compile', 0.0) + 60.0  # a probe inside compiled for 60 s
    assert spent.seconds['judging'] < 60.0
    assert 'compile 60.0 s' in spent.line()


SIBLINGS = textwrap.dedent('''
    import json, os, sys
    import torch, torch.nn as nn
    sys.path.insert(0, sys.argv[1])
    from timm_ext.child_process import call_forked
    from timm_ext.probe.compiled_trials import BatchDynamic, compile_counts

    class Task(nn.Module):
        def __init__(self):
            super().__init__()
            self.trainable_module = torch.compile(nn.Linear(8, 2))

    task = Task()
    BatchDynamic(task)

    def trial(rows):
        with torch.no_grad():
            task.trainable_module(torch.randn(rows, 8))
        counts = compile_counts()
        return [counts.compiled, counts.loaded]

    print(json.dumps([call_forked(lambda: trial(rows))[0] for rows in (3, 7)]))
''')


@pytest.mark.skipif(sys.platform != 'linux', reason='forked trials are Linux')
def test_a_forked_sibling_loads_the_graph_the_first_compiled_at_another_batch(tmp_path):
    """torch/_inductor/codecache.py FxGraphCache (on by default, torch/_inductor/config.py fx_graph_cache): graphs
    are kept on disk under TORCHINDUCTOR_CACHE_DIR, where a later process, a fork of the same parent included, loads
    one whose key and guards match; with the batch dimension symbolic the key is the same at every batch size."""
    env = {**os.environ, 'TORCHINDUCTOR_CACHE_DIR': str(tmp_path / 'cache'), 'OMP_NUM_THREADS': '1'}
    done = subprocess.run([sys.executable, '-c', SIBLINGS, str(REPO_ROOT)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = eval(done.stdout.strip().splitlines()[-1])
    assert first == [1, 0], 'the first trial compiles its graph'
    assert second == [0, 1], 'its sibling at another batch loads it'
