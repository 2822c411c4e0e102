"""Compiled CPU trials that share one compile: the batch dimension dynamic, the graphs on inductor's disk cache.

Each CPU trial runs in a fork of the probing process (`timm_ext.probe.forked`), which cannot compile the training step
for its children: compiling it traces a backward pass, after which torch refuses autograd in every later fork
(`timm_ext.child_process.fork_runs_autograd`). So every trial compiled its own graphs, one full compile per trial,
and none could reuse another's: a graph compiled for one batch size has that size in its kernels.

Two facts of torch 2.14.1 make one compile serve the whole probe:

* Inductor's FX graph cache (`torch._inductor.config.fx_graph_cache`, env TORCHINDUCTOR_FX_GRAPH_CACHE) and
  AOTAutograd's cache (`torch._functorch.config.enable_autograd_cache`, env TORCHINDUCTOR_AUTOGRAD_CACHE) are on by
  default and live on disk under `torch._inductor.runtime.cache_dir_utils.cache_dir()` (TORCHINDUCTOR_CACHE_DIR,
  else /tmp/torchinductor_<user>), so a forked sibling loads what an earlier one compiled; nothing of a child's
  in-memory caches reaches its siblings or parent.
* A graph traced with the batch dimension symbolic (`torch._dynamo.maybe_mark_dynamic` on the input) has one cache key
  for every batch size; its guards, checked against each call's sizes, decide whether it serves.

So `BatchDynamic` marks the batch dimension of the compiled modules' inputs, and a trial that had to compile under the
cap is run again after an uncapped run compiled what it lacked (`compiled_first`): every kept trial loads its graphs.
Dynamo still traces the model's Python in every process (seconds); the compile (AOTAutograd, inductor, the C++
compiler) is skipped. Inductor guards each graph on the range of batch sizes its code was generated for, so a probe
compiles once for each range its sizes fall in (one to three), not once per trial. Measured on this CPU
(bench/bench_compile_dynamic.py, float32 training step, torch.profiler's memory events): a graph with the batch
dimension dynamic holds the same peak as the static one at the same batch.

A trial measures what loading its graphs takes under the cap, not what compiling them takes (a compile's own heap,
tens to hundreds of MB, stays in the process): so a train.py that compiles its graphs itself under the same cap holds
more than the trial did. The probe therefore also compiles train.py's own graphs, static, at the planned batch
(`compile_run_graphs`), and train.py finds them in the cache: the compile it pays ahead, not an extra one.
"""
import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .table import Trial, TrialFn

__all__ = ['BatchDynamic', 'CompileCounts', 'compile_counts', 'compiled_first', 'counting_compiles', 'graph_cache_on']


def graph_cache_on() -> bool:
    """Whether inductor keeps compiled graphs in its local disk cache, where a trial's siblings find them: the local
    part of `use_cache` in torch/_inductor/compile_fx.py (`fx_graph_cache`, unless `force_disable_caches`)."""
    from torch._inductor import config
    return bool(config.fx_graph_cache) and not config.force_disable_caches


class BatchDynamic:
    """Marks dimension 0 of the first input of each compiled module of a task dynamic, while `enabled`.

    The mark is set in a forward pre-hook of the compiled module itself (`torch._dynamo.eval_frame.OptimizedModule`),
    which runs outside the compiled frame, before dynamo sees the input. `maybe_mark_dynamic` lets a model that
    needs a fixed batch specialize it (then each batch compiles, as without the mark), and dynamo specializes sizes
    0 and 1 anyway.

    Args:
        task: The training task whose compiled modules are marked (train model, eval model, EMA eval model).
    """

    def __init__(self, task: torch.nn.Module):
        from torch._dynamo.eval_frame import OptimizedModule
        self.enabled = True
        self.modules = [m for m in task.modules() if isinstance(m, OptimizedModule)]
        for module in self.modules:
            module.register_forward_pre_hook(self._mark)

    def _mark(self, module: torch.nn.Module, args: Tuple) -> None:
        if self.enabled and args and torch.is_tensor(args[0]) and args[0].dim() > 0:
            torch._dynamo.maybe_mark_dynamic(args[0], 0)


# dynamo's timer of a whole frame's compile (tracing, AOTAutograd, inductor; a cache hit's loading)
_FRAME_COMPILE_TIMER = '_compile.compile_inner'


@dataclass(frozen=True)
class CompileCounts:
    """What this process compiled so far: seconds in dynamo's frame compiles, inductor graphs compiled and loaded.

    Attributes:
        seconds: Wall seconds of dynamo's frame compiles (`torch._dynamo.utils.compilation_time_metrics`).
        compiled: Inductor graphs compiled (FX graph cache misses and bypasses; forward and backward count apart).
        loaded: Inductor graphs loaded from the FX graph cache (hits).
    """
    seconds: float = 0.0
    compiled: int = 0
    loaded: int = 0

    def since(self, before: 'CompileCounts') -> Optional['CompileCounts']:
        """What was compiled after `before`; None when nothing was."""
        delta = CompileCounts(self.seconds - before.seconds, self.compiled - before.compiled,
                              self.loaded - before.loaded)
        return delta if delta.seconds > 0 or delta.compiled or delta.loaded else None


def compile_counts() -> CompileCounts:
    """This process's `CompileCounts` (all zero where dynamo was never imported: nothing compiled)."""
    if 'torch._dynamo.utils' not in sys.modules:
        return CompileCounts()
    from torch._dynamo.utils import compilation_time_metrics, counters
    inductor = counters['inductor']
    return CompileCounts(sum(compilation_time_metrics.get(_FRAME_COMPILE_TIMER, ())),
                         inductor['fxgraph_cache_miss'] + inductor['fxgraph_cache_bypass'], inductor['fxgraph_cache_hit'])


def counting_compiles(trial: TrialFn) -> TrialFn:
    """`trial` with what this process compiled while it ran (a compiled step: the seconds, the graphs compiled and
    loaded); a trial that compiled nothing is left as it is."""
    def run(batch_size: int) -> Trial:
        before = compile_counts()
        done = trial(batch_size)
        compiled = compile_counts().since(before)
        if compiled is None:
            return done
        return dataclasses.replace(done, compile_s=compiled.seconds, graphs_compiled=compiled.compiled,
                                   graphs_loaded=compiled.loaded)
    return run


def compiled_first(trial: TrialFn, compile_run: TrialFn, seconds: List[float]) -> TrialFn:
    """A capped trial that compiled is run again once its graphs are compiled: its trial loads them, as train.py does.

    Inductor guards a graph with the batch dimension dynamic on the range of sizes its code was generated for (here:
    compiled at 2, test_resnet's graphs held for 2-15; at 180, for 16 and up and for 65-256), so no single compile
    serves every size a search may try, and a size outside every range compiles. A trial that compiled under the cap
    counted the compile's own heap (tens of MB, resident after) and may have run out of memory compiling: so when a
    trial compiled anything, or died before it could say, `compile_run` (the trial's warm-up with no cap,
    `timm_ext.probe.trial_host.uncapped_trial`) compiles what is missing, and the trial runs again, loading it. The
    first size gets the compile run first (nothing is known compiled yet), and a size whose trial loaded every graph
    is not checked again (re-timing).

    Args:
        trial: The capped trial.
        compile_run: The uncapped run of the trial's warm-up, in a process of its own.
        seconds: The wall seconds spent compiling outside the kept trials are appended here: each discarded capped
            run and each compile run.

    Returns:
        The trial that loaded its graphs, or, when the uncapped run failed, its failure (an error stops the search:
        the step fails anyway).
    """
    loaded = set()

    def run(batch_size: int) -> Trial:
        if batch_size in loaded:
            return trial(batch_size)
        started = time.perf_counter()
        if loaded or seconds:  # a graph is in the cache: this size may load it
            first = trial(batch_size)
            if first.graphs_compiled == 0:
                loaded.add(batch_size)
                return first
        check = compile_run(batch_size)
        seconds.append(time.perf_counter() - started)
        if not check.fits:
            return check
        loaded.add(batch_size)
        return trial(batch_size)
    return run
