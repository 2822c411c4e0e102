"""The measured trial: one batch size run for real, its peak memory and step time, or the failure it met.

`measured_trial` turns a step that raises on failure into a `TrialFn` for the search: memory freed and the peak
meter reset before, warm-up then timed steps, an OOM told apart from other errors (`timm_ext.oom`), and memory freed
after a failure too, so every trial starts from the state the first one did.
"""
import contextlib
import math
import time
import traceback
from typing import Callable, Optional

import torch

from ..memory import PeakMeter, free_heap_held, free_memory, free_memory_after_failure
from ..oom import is_oom
from .compiled_trials import counting_compiles
from .forked import run_forked
from .table import ERROR, FIT, OOM, Trial, TrialFn

__all__ = ['measured_trial']


def _one_line(exc: BaseException) -> str:
    text = ' '.join(str(exc).split())
    return f'{type(exc).__name__}: {text}'[:300]


def _synchronize(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def measured_trial(
        step: Callable[[int], object],
        device: torch.device,
        meter: Optional[PeakMeter] = None,
        warmup_steps: int = 0,
        timed_steps: int = 1,
        capped: bool = False,
        before: Optional[Callable[[], None]] = None,
        isolate: bool = False,
        warmup: Optional[Callable[[int], object]] = None,
        benchmark_warmup: bool = False,
) -> TrialFn:
    """Turn `step(batch_size)`, which runs one batch and raises on failure, into a trial for the search.

    The trial frees memory, resets the peak meter, runs `warmup_steps` then `timed_steps` steps (peak covers all),
    and reports fit, OOM or error, and what it compiled. The step time is the fastest timed step, as `timeit` advises
    (on a shared machine the slower ones were disturbed). A failure's frames are cleared and memory freed.

    Args:
        step: Runs one step at a batch size; OOMs and other errors propagate out of it.
        device: Device the step runs on (synchronized around the timing, freed between trials).
        meter: Peak-memory meter (`None`: a meter on `device` with no baseline).
        warmup_steps: Untimed steps first (e.g. one training step that allocates the optimizer state).
        timed_steps: Steps timed for ms/step and samples/s.
        capped: A memory cap is in force: a forked trial killed by a signal counts as OOM (`run_forked`).
        before: Called before each trial (reset gradients, optimizer state, scaler).
        isolate: CPU only: run each trial in a forked copy of this process (see `run_forked`).
        warmup: Runs a warm-up step instead of `step` (e.g. an update and then an eval pass); default `step`.
        benchmark_warmup: Run the warm-up once more first, then reset and free: with `cudnn.benchmark` a step at new
            shapes first runs cuDNN's algorithm search, its workspaces sized to the free memory (the run pays it once).
    """
    device = torch.device(device)
    meter = meter or PeakMeter(device)
    if isolate and device.type != 'cpu':
        raise ValueError('isolated trials are for CPU devices; CUDA frees its memory in-process')

    def run_here(batch_size: int) -> Trial:
        if before is not None:
            before()
        free_memory(device)
        with free_heap_held() if device.type == 'cpu' else contextlib.nullcontext():
            return measure(batch_size)

    @counting_compiles
    def measure(batch_size: int) -> Trial:
        meter.reset()
        try:
            if benchmark_warmup:
                for _ in range(warmup_steps):
                    (warmup or step)(batch_size)
                if before is not None:
                    before()
                free_memory(device)
                meter.reset()
            for _ in range(warmup_steps):
                (warmup or step)(batch_size)
            _synchronize(device)
            seconds = math.inf
            for _ in range(timed_steps):
                start = time.perf_counter()
                step(batch_size)
                _synchronize(device)
                seconds = min(seconds, time.perf_counter() - start)
            peak = meter.peak()
        except Exception as e:  # every failure is reported as a trial; only OOMs let the search go on
            oom = is_oom(e)  # under the cap oneDNN's primitive failures are OOMs too (the process's limit says)
            trial = Trial(batch_size, OOM if oom else ERROR, error=_one_line(e))
            traceback.clear_frames(e.__traceback__)  # the frames hold the failed step's activations
        else:
            timed = math.isfinite(seconds) and seconds > 0
            trial = Trial(batch_size, FIT, peak_bytes=peak, ms_per_step=seconds * 1000 if timed else None,
                          samples_per_s=batch_size / seconds if timed else None)
        if before is not None:
            before()
        (free_memory_after_failure if trial.status == ERROR else free_memory)(device)
        return trial

    if isolate:
        return lambda batch_size: run_forked(lambda: run_here(batch_size), batch_size, capped)
    return run_here
