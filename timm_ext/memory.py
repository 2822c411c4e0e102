"""Memory budgets, caps that make a real out-of-memory happen at the budget, and peak-memory measurement.

A probe needs the process to fail for real when a batch needs more than the budget, and to measure how close each
fitting batch came to it:

* CUDA: `torch.cuda.set_per_process_memory_fraction` caps the caching allocator at budget / device total, so a
  larger batch raises `torch.OutOfMemoryError`. The cap limits what the allocator *reserves* (it refuses when
  reserved + the new segment would pass the fraction), so the budget counts everything this process reserves on the
  device (weights included), and the peak is `torch.cuda.max_memory_reserved` since the last reset: allocated bytes
  would leave out the fragmentation that makes the cap bite. Memory outside the allocator (the CUDA context, NCCL
  buffers, other processes) is not in the fraction, so a fractional budget is taken of what the device can still
  give this process: `torch.cuda.mem_get_info`'s free bytes plus what this process's allocator already holds.
* CPU (Linux): `RLIMIT_DATA` set to the process's current data segment (VmData) + budget, so PyTorch's allocator gets
  ENOMEM and raises "DefaultCPUAllocator: can't allocate memory". The budget counts memory *above* what the process
  holds when the cap is set (model, optimizer, libraries are already there). Peak: VmData, the very quantity the
  cap limits, above its value at cap time. The kernel keeps no high-water mark of VmData (VmHWM is the resident
  set, which misses reserved-but-untouched pages the cap does count, and counts library pages it does not), so a
  small-stack thread samples it every 0.5 ms while a trial runs (ATen releases the GIL inside ops): a spike
  shorter than that can be missed, so the figure is a close lower bound.

`memory_cap` always restores the previous limit on exit, Ctrl-C included.

Why CPU peaks hold between processes (`steady_cpu_heap`): glibc raises its mmap threshold each time a large block
is freed, after which blocks up to 32 MiB come from the heap, where freed space fragments and stays in the data
segment. Measured on resnet18 at 112 px, batch 100, SGD, one thread, 3 updates in fresh processes: the peak above the
cap's baseline was 0.92-1.19 GB and what stayed after the step 0.71-1.03 GB, so the largest batch that held under
1 GiB moved by a tenth between processes. With the threshold fixed at glibc's own starting 128 KiB the same runs
peaked at 663.0 MB (+-0.1 MB), kept 74 MB, and the batch that holds under 1 GiB is about 173 (it was 105-114).
"""
import ctypes
import ctypes.util
import gc
import logging
import os
import re
import resource
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

from .errors import TimmExtError

__all__ = [
    'BudgetError', 'MemoryBudget', 'MemoryCap', 'PeakMeter', 'parse_budget', 'format_bytes', 'device_total_memory',
    'device_available_memory', 'device_name', 'physical_memory', 'memory_cap', 'free_memory', 'proc_status',
    'data_and_stack', 'device_broken', 'free_memory_after_failure', 'steady_cpu_heap', 'trains_on_steady_heap',
    'free_heap_held', 'default_headroom',
]

_logger = logging.getLogger(__name__)

_UNITS = {
    '': 1, 'b': 1,
    'k': 1 << 10, 'kib': 1 << 10, 'kb': 10 ** 3,
    'm': 1 << 20, 'mib': 1 << 20, 'mb': 10 ** 6,
    'g': 1 << 30, 'gib': 1 << 30, 'gb': 10 ** 9,
    't': 1 << 40, 'tib': 1 << 40, 'tb': 10 ** 12,
}
_BUDGET_RE = re.compile(r'^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*|%)\s*$', re.IGNORECASE)

DeviceLike = Union[str, torch.device]


class BudgetError(TimmExtError, ValueError):
    """A memory budget that cannot be parsed or cannot be had on the device; the message is one line."""
    exit_status = 2


def format_bytes(num_bytes: Optional[float]) -> str:
    """Human-readable size in binary units, e.g. '1.50 GiB'; '-' for None."""
    if num_bytes is None:
        return '-'
    value = float(num_bytes)
    for unit in ('B', 'KiB', 'MiB', 'GiB'):
        if abs(value) < 1024:
            return f'{value:.0f} {unit}' if unit == 'B' else f'{value:.2f} {unit}'
        value /= 1024
    return f'{value:.2f} TiB'


_OVER_AVAILABLE_WARNED: set = set()  # (budget bytes, device) pairs whose over-budget warning was given


@dataclass(frozen=True)
class MemoryBudget:
    """A budget as the user wrote it: an absolute size in bytes, or a fraction of the device's memory.

    Exactly one of `num_bytes` and `fraction` is set.
    """
    num_bytes: Optional[int] = None
    fraction: Optional[float] = None

    def resolve(self, device: DeviceLike) -> int:
        """The budget in bytes on `device`: a fraction of what it can still give (`device_available_memory`), or
        the absolute size, with a warning on CUDA when that is more than the device can give now.

        Raises:
            BudgetError: The budget is larger than the device's memory.
        """
        available = device_available_memory(device)
        if self.fraction is not None:
            return int(available * self.fraction)
        total = device_total_memory(device)
        if self.num_bytes > total:
            what = 'memory the system can still give (MemAvailable)' if _device(device).type == 'cpu' else 'memory'
            raise BudgetError(f'memory budget {format_bytes(self.num_bytes)} is larger than the {what} of '
                              f'{device_name(device)}: {format_bytes(total)}; pass a smaller --mem-budget '
                              f'or a fraction such as 0.8')
        warned = (self.num_bytes, device_name(device))
        if self.num_bytes > available and warned not in _OVER_AVAILABLE_WARNED:
            _OVER_AVAILABLE_WARNED.add(warned)  # once a process: tune_batch resolves it for every probe it runs
            _logger.warning(f'Memory budget {format_bytes(self.num_bytes)} is more than {device_name(device)} can '
                            f'give this process now ({format_bytes(available)}: free plus what it holds; the CUDA '
                            f'context, NCCL and other processes take the rest): trials near the budget fail outside '
                            f'the cap, and the chosen batch may not fit when training starts.')
        return self.num_bytes

    def __str__(self) -> str:
        if self.fraction is not None:
            return f'{self.fraction * 100:.4g}% of available memory'
        return format_bytes(self.num_bytes)


def parse_budget(text: Union[str, float, int]) -> MemoryBudget:
    """Parse a budget: a size with a unit ('12GiB', '500MB', '2g') or a fraction of the device ('0.8', '80%').

    A number without a unit must be a fraction in (0, 1]: a bare '12' is refused rather than read as 12 bytes.

    Raises:
        BudgetError: The text is not a size or a fraction, or is not positive.
    """
    raw = str(text)
    match = _BUDGET_RE.match(raw)
    if not match:
        raise BudgetError(f"memory budget {raw!r} is not a size or a fraction; write e.g. '12GiB', '500MB' or '0.8'")
    value, unit = float(match.group(1)), match.group(2).lower()
    if value <= 0:
        raise BudgetError(f'memory budget {raw!r} must be positive')
    if unit == '%':
        value, unit = value / 100, ''
        if value > 1:
            raise BudgetError(f'memory budget {raw!r} is more than 100% of the device; use at most 100%')
        return MemoryBudget(fraction=value)
    if unit == '':
        if value > 1:
            raise BudgetError(f"memory budget {raw!r} has no unit; write a size such as '{raw}GiB' or a fraction "
                              f"of device memory in (0, 1] such as '0.8'")
        return MemoryBudget(fraction=value)
    if unit not in _UNITS:
        raise BudgetError(f"memory budget {raw!r}: unknown unit {match.group(2)!r}; use B, KiB, MiB, GiB, TiB "
                          f"(or KB, MB, GB, TB)")
    return MemoryBudget(num_bytes=int(value * _UNITS[unit]))


def _device(device: DeviceLike) -> torch.device:
    device = torch.device(device)
    if device.type == 'cuda' and device.index is None:
        device = torch.device('cuda', torch.cuda.current_device())
    return device


def proc_status(*keys: str) -> dict:
    """Fields of /proc/self/status in bytes (e.g. 'VmData', 'VmRSS', 'VmHWM'); Linux only."""
    values = {}
    with open('/proc/self/status') as f:
        for line in f:
            key, _, rest = line.partition(':')
            if key in keys:
                values[key] = int(rest.split()[0]) * 1024  # the kernel reports kB
    return values


def data_and_stack() -> int:
    """VmData + VmStk in bytes (/proc/self/statm), the figure the CPU peak sampler reads."""
    with open('/proc/self/statm') as f:
        return int(f.read().split()[5]) * os.sysconf('SC_PAGE_SIZE')


def _meminfo(key: str) -> int:
    with open('/proc/meminfo') as f:
        for line in f:
            if line.startswith(key + ':'):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def device_total_memory(device: DeviceLike) -> int:
    """Memory a budget is measured against: the CUDA device's total, or on CPU what the system can still give.

    CPU uses MemAvailable, not MemTotal: a budget beyond it would meet the kernel's OOM killer, which cannot be
    caught, instead of a catchable allocation failure.
    """
    device = _device(device)
    if device.type == 'cuda':
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == 'cpu':
        _require_linux()
        return _meminfo('MemAvailable')
    raise BudgetError(f'memory budgets are supported on cuda and cpu devices, not {device.type}')


def device_available_memory(device: DeviceLike) -> int:
    """Memory this process can still have on `device`: CUDA's free memory (`mem_get_info`) plus what this process's
    caching allocator already reserves (the fraction cap counts it, and it can be reused); on CPU, MemAvailable."""
    device = _device(device)
    if device.type == 'cuda':
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device)
    return device_total_memory(device)


def physical_memory(device: DeviceLike) -> int:
    """The device's installed memory: CUDA total, or MemTotal for the CPU (for cache keys and reports)."""
    device = _device(device)
    if device.type == 'cuda':
        return torch.cuda.get_device_properties(device).total_memory
    _require_linux()
    return _meminfo('MemTotal')


def device_name(device: DeviceLike) -> str:
    """A name for the device that identifies the hardware (for logs and cache keys)."""
    device = _device(device)
    if device.type == 'cuda':
        return torch.cuda.get_device_name(device)
    if device.type == 'cpu':
        return f'cpu ({os.cpu_count()} cores, {format_bytes(_meminfo("MemTotal") if sys.platform == "linux" else 0)})'
    return str(device)


def _require_linux() -> None:
    if sys.platform != 'linux':
        raise BudgetError('CPU memory caps need Linux (RLIMIT_DATA and /proc); on this system probe on a CUDA '
                          'device or pass --batch-size directly')


@dataclass(frozen=True)
class MemoryCap:
    """A cap in force: what it allows and where usage is counted from.

    Attributes:
        device: The capped device.
        budget: Bytes the cap in force allows (CPU: above `baseline`, less than asked under a lower hard limit;
            CUDA: in total).
        baseline: CPU: VmData + VmStk when the cap was set, the zero of peak measurements; CUDA: 0.
    """
    device: torch.device
    budget: int
    baseline: int


@contextmanager
def memory_cap(device: DeviceLike, budget: int) -> Iterator[MemoryCap]:
    """Cap the memory this process may take on `device` at `budget` bytes while the block runs.

    CPU: RLIMIT_DATA = current VmData + budget (never above the hard limit). CUDA: the allocator's per-process
    fraction = budget / total. The previous limit is restored on exit, however the block ends.

    Raises:
        BudgetError: The budget is larger than the CUDA device, or the device type cannot be capped.
    """
    device = _device(device)
    if budget <= 0:
        raise BudgetError(f'memory budget must be positive, got {budget} bytes')
    if device.type == 'cuda':
        total = torch.cuda.get_device_properties(device).total_memory
        if budget > total:
            raise BudgetError(f'memory budget {format_bytes(budget)} is larger than {device_name(device)} '
                              f'({format_bytes(total)}); pass a smaller --mem-budget')
        previous = torch.cuda.get_per_process_memory_fraction(device)
        torch.cuda.empty_cache()  # cached blocks above the new cap would otherwise stay usable
        torch.cuda.set_per_process_memory_fraction(budget / total, device)
        try:
            yield MemoryCap(device, budget, 0)
        finally:
            torch.cuda.set_per_process_memory_fraction(previous, device)
        return
    if device.type != 'cpu':
        raise BudgetError(f'memory caps are supported on cuda and cpu devices, not {device.type}')
    _require_linux()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    vmdata = proc_status('VmData')['VmData']
    limit = vmdata + budget
    if hard != resource.RLIM_INFINITY and limit > hard:
        _logger.warning(f'RLIMIT_DATA hard limit {format_bytes(hard)} is below the asked cap; capping there.')
        limit = hard
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        yield MemoryCap(device, limit - vmdata, data_and_stack())
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


class PeakMeter:
    """Peak memory of the work done since `reset()`, in the units a budget on the device counts.

    CUDA: `torch.cuda.max_memory_reserved`, what the per-process fraction cap limits (tensors plus the allocator's
    cached and fragmented segments).
    CPU (Linux): the highest VmData sampled since `reset()`, minus `baseline` (VmData when the cap was set).

    Args:
        device: The device to measure.
        baseline: CPU: bytes to subtract (`MemoryCap.baseline`); CUDA: ignored.
        interval: CPU sampling period in seconds.
    """

    def __init__(self, device: DeviceLike, baseline: int = 0, interval: float = 0.0005):
        self.device = _device(device)
        self.baseline = baseline
        self.interval = interval
        self._sampler: Optional[_VmDataSampler] = None

    def reset(self) -> None:
        if self.device.type == 'cuda':
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == 'cpu' and sys.platform == 'linux':
            if self._sampler is None or not self._sampler.alive():  # threads do not survive a fork
                self._sampler = _VmDataSampler(self.interval)
            self._sampler.restart()

    def peak(self) -> Optional[int]:
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_reserved(self.device)
        if self._sampler is not None and self._sampler.alive():
            return max(0, self._sampler.stop() - self.baseline)
        return None


class _VmDataSampler:
    """A daemon thread with a small stack that records the largest VmData seen while armed."""

    def __init__(self, interval: float):
        self.interval = interval
        self.highest = 0
        self._armed = threading.Event()
        self._lock = threading.Lock()
        self._fd = os.open('/proc/self/statm', os.O_RDONLY)
        self._page = os.sysconf('SC_PAGE_SIZE')
        previous = threading.stack_size(256 * 1024)  # its stack is data the cap counts: keep it small
        try:
            self._thread = threading.Thread(target=self._run, name='vmdata-sampler', daemon=True)
            self._thread.start()
        finally:
            threading.stack_size(previous)

    def read(self) -> int:
        # statm's 6th field is data + stack in pages: VmData + VmStk, which is what RLIMIT_DATA sees
        return int(os.pread(self._fd, 256, 0).split()[5]) * self._page

    def _run(self) -> None:
        while True:
            self._armed.wait()
            with self._lock:  # a sample read before a restart must not land after it (a loaded machine delays it)
                if self._armed.is_set():
                    self.highest = max(self.highest, self.read())
            time.sleep(self.interval)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def restart(self) -> None:
        with self._lock:
            self.highest = self.read()
            self._armed.set()

    def stop(self) -> int:
        with self._lock:
            self._armed.clear()
            return max(self.highest, self.read())


_libc = None


def _malloc_trim() -> None:
    """Hand freed heap pages back to the OS (glibc), so a failed large batch does not inflate the next trial."""
    global _libc
    if sys.platform != 'linux':
        return
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_M_MMAP_THRESHOLD = -3  # mallopt parameter, from glibc's <malloc.h>
STEADY_MMAP_THRESHOLD = 128 * 1024  # glibc's starting threshold; fixing it stops the dynamic raise
_STEADY = [False]


def _glibc() -> Optional[ctypes.CDLL]:
    """This process's C library when it is glibc on Linux and the user set no mmap threshold of their own
    (MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES), else None: where `steady_cpu_heap` can act."""
    if sys.platform != 'linux' or 'MALLOC_MMAP_THRESHOLD_' in os.environ or \
            'mmap_threshold' in os.environ.get('GLIBC_TUNABLES', ''):
        return None
    try:
        libc = ctypes.CDLL(None)
        return libc if libc.gnu_get_libc_version else None
    except (OSError, AttributeError):  # not glibc
        return None


def steady_cpu_heap() -> bool:
    """Fix glibc's mmap threshold at 128 KiB, so large blocks are always mapped and handed back when freed.

    This makes a CPU process's peak memory the same in every process (see the module docstring), at a cost: every
    large block is a fresh mapping with fresh page faults (resnet18 at 112 px, batch 64, oneDNN on: 1.17 s a step
    with glibc's dynamic threshold, 1.69-1.93 s with it fixed; peak 668 MB against 445 MB). So it is set only where
    a memory cap is in force: in the probe's trial children (`timm_ext.probe.trial`), whose peaks choose the batch,
    and in a train.py / validate.py run started under a data-segment cap or with ``--steady-cpu-heap`` (which
    tune_batch.py puts on the train command of a CPU run tuned under a budget: `trains_on_steady_heap`), which must
    peak as its probe did. A threshold the user set is left alone, as is any libc other than glibc. glibc has no
    way back to its dynamic threshold: a process that sets it keeps it.

    Returns:
        Whether the threshold is fixed in this process (by this call or an earlier one).
    """
    if _STEADY[0]:
        return True
    libc = _glibc()
    _STEADY[0] = bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD))
    return _STEADY[0]


@contextmanager
def free_heap_held(largest: int = 64 << 20) -> Iterator[int]:
    """Hold the free heap's large blocks while the block runs, so what it allocates counts as new memory.

    glibc consults the mmap threshold only when no free chunk fits a request: a process whose heap has free space
    (a notebook that trained before, a parent forked with a large heap) serves the step's large blocks from it and
    its data segment does not grow, so a trial there measured a peak near zero, and its cap let it take memory a
    fresh train.py would have had to ask for (test_resnet at 64 px, batch 48: 0.3 MB after a resnet18 step in the
    same process, 61 MB in a fresh one). Under the steady heap each block of the threshold or more taken here without
    the data segment growing is free space; held, the step's blocks are mapped as in a fresh process. The blocks are
    never touched (no resident memory) and are handed back on exit. Elsewhere (no glibc, or its dynamic threshold,
    where large blocks come from the heap anyway) this does nothing.

    Yields:
        Bytes of free heap held.
    """
    libc = _glibc() if _STEADY[0] else None
    held = []
    if libc is not None:
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        size, data = largest, data_and_stack()
        while size >= STEADY_MMAP_THRESHOLD:
            block = libc.malloc(size)
            grown = data_and_stack() > data
            if block and not grown:
                held.append((block, size))
                continue
            if block:  # a new mapping or a heap extension: no free space of this size is left
                libc.free(block)
                data = data_and_stack()
            size //= 2
    try:
        yield sum(size for _, size in held)
    finally:
        for block, _ in held:
            libc.free(block)


def trains_on_steady_heap(device: DeviceLike, budget_asked: bool) -> bool:
    """Whether a run tuned for `device` must train with the steady heap (train.py's ``--steady-cpu-heap``).

    On CPU under a budget the user asked, where `steady_cpu_heap` can act: the probe's trials (and the CPU estimate)
    measured their peaks with it, and glibc's dynamic threshold peaks higher, by a different amount in each process
    (the module docstring), so the chosen batch would hold only if the cap were already there when train.py starts.
    With the flag it holds whenever the cap comes: set before the start, after it (prlimit, a ulimit in the job
    script), or another process taking the rest. No budget asked: stock's heap and stock's speed.
    """
    return torch.device(device).type == 'cpu' and budget_asked and _glibc() is not None


def default_headroom(device: DeviceLike) -> float:
    """The share of the budget a chosen batch leaves free when none is asked: 5% on CPU, 10% elsewhere.

    On CPU with the steady heap (which the probe's trials set wherever it can act) the measured peak is what the cap
    sees, the same in every process: resnet18 at 112 px under 1 GiB peaked within 0.1 MB across fresh processes, and
    batch 173, sampled at 99.8% of the budget, held under it. 5% is many times that spread and keeps the choice near
    the largest batch that holds. A CUDA run's reserved memory depends more on the allocator's history (the training
    loop's, not the probe's), so it keeps 10%.
    """
    steady = _STEADY[0] or _glibc() is not None
    return 0.05 if torch.device(device).type == 'cpu' and steady else 0.1  # no CUDA call: plans need no GPU


def free_memory(device: DeviceLike) -> None:
    """Release what freed tensors left behind: Python garbage, the CUDA cache and peak stats, glibc's free heap."""
    device = _device(device)
    gc.collect()
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == 'cpu':
        _malloc_trim()


def device_broken(device: DeviceLike) -> bool:
    """Whether `device` can no longer run work: a sticky CUDA error (illegal memory access, device-side assert) makes
    every later call on the context raise, a sync and a collective's own buffers included. CPU: never."""
    if torch.device(device).type != 'cuda':
        return False
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - whatever the context raises, it is not usable
        return True
    return False


def free_memory_after_failure(device: DeviceLike) -> bool:
    """`free_memory` after a step failed with an error that is being reported: on a broken CUDA context the sync in
    it raises again, and that second error (a raw traceback) would replace the first. Cleanup is skipped then.

    Returns:
        Whether the memory was freed (False: the device raised; the process should stop using it).
    """
    try:
        free_memory(device)
    except Exception:  # noqa: BLE001 - the first failure is the one to report
        return False
    return True
