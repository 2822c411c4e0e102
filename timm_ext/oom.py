"""Tell out-of-memory failures apart from every other failure, so only OOMs lead to a smaller batch.

`is_oom` looks at the exception type first (`torch.OutOfMemoryError`, Python's `MemoryError`), then at the messages
the allocators of each backend raise. `should_retry` is the policy: retry with a smaller batch only on an OOM, and
never on errors that leave the device unusable or that a smaller batch cannot fix. They are the one home of the rule
for the probe's trials, train.py's `--oom-recover` and validate.py's `--retry`: none of them decides for itself
whether a CPU cap is in force, `is_oom` reads it from the process (`cpu_data_capped`).
"""
import resource
from typing import Iterator, Optional

import torch

__all__ = ['is_oom', 'should_retry', 'cpu_data_capped', 'OOM_MESSAGES', 'FATAL_MESSAGES',
           'CAPPED_CPU_OOM_MESSAGES']

# Lower-cased fragments of the messages each backend raises when an allocation fails.
OOM_MESSAGES = (
    'out of memory',                          # CUDA ("CUDA out of memory", "CUDA error: out of memory"), XPU, MPS
    "can't allocate memory",                  # CPU: DefaultCPUAllocator under a memory limit
    'posix_memalign failed',                  # CPU: ATen's aligned buffers (grouped convolutions) under a limit
    'cudnn_status_not_supported',             # cuDNN gives up when a batch needs too large a workspace
    'cublas_status_alloc_failed',             # cuBLAS handle/workspace allocation
    'cudnn_status_alloc_failed',
    # cuDNN's frontend when no engine can get its workspace: an OOM in disguise under memory pressure
    # (pytorch#108645). A missing or broken cuDNN library says the same; then every size down to 1 fails too, and
    # the final error quotes this message, so that case costs a few quick retries, never a wrong answer.
    'unable to find an engine',
)

# oneDNN (CPU convolutions, matmuls) reports a failed allocation as a failure to create its primitive (its JIT code
# and buffers) or to execute it (its scratchpad), with no word of memory. Under a CPU data cap that is the cap
# speaking; without one it may be anything (a configuration oneDNN does not implement), so these count as an OOM only
# while capped. A thread that cannot start says EAGAIN ("Resource temporarily unavailable", the autograd engine's
# workers at a step's first backward): its stack is a private mapping, which RLIMIT_DATA counts since Linux 4.7.
# C++'s `operator new` failing surfaces as "std::bad_alloc" (an ATen or oneDNN structure, not a tensor's storage).
CAPPED_CPU_OOM_MESSAGES = ('could not create a primitive', 'could not execute a primitive',
                           'resource temporarily unavailable', 'std::bad_alloc')

# Lower-cased fragments of errors that must never be retried, even when they mention memory.
FATAL_MESSAGES = (
    'illegal memory access',                  # CUDA context is corrupted: every later kernel fails too
    'illegal instruction',
    'device-side assert',                     # e.g. a label out of range: same failure at any batch size
    'required rank',                          # channels_last asked of a tensor that is not 4-D
    'misaligned address',
)


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """Yield `exc` and the exceptions it was raised from (torch.compile and DataLoader wrap the real error)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _message(exc: BaseException) -> str:
    return str(exc).lower()


def cpu_data_capped() -> bool:
    """True when this process runs under a data-segment limit (RLIMIT_DATA), as the CPU memory caps set."""
    try:
        return resource.getrlimit(resource.RLIMIT_DATA)[0] != resource.RLIM_INFINITY
    except (ValueError, OSError):
        return False


def is_oom(exc: BaseException, cpu_capped: Optional[bool] = None) -> bool:
    """Return True when `exc` (or an exception it wraps) is an out-of-memory failure of any backend.

    Args:
        exc: The failure.
        cpu_capped: Whether a CPU memory cap is in force, so oneDNN's primitive failures count as OOM too. None (what
            every caller in timm_ext passes): this process's own data-segment limit says (`cpu_data_capped`), as it
            stood when the failure is judged; the probe judges inside its cap, the uncapped check outside it.
    """
    for err in _exception_chain(exc):
        if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(err, RuntimeError):
            msg = _message(err)
            if any(fatal in msg for fatal in FATAL_MESSAGES):
                return False
            if any(oom in msg for oom in OOM_MESSAGES):
                return True
            onednn = any(m in msg for m in CAPPED_CPU_OOM_MESSAGES)
            if onednn and (cpu_data_capped() if cpu_capped is None else cpu_capped):
                return True
    return False


def should_retry(exc: BaseException, cpu_capped: Optional[bool] = None) -> bool:
    """Return True when running again with a smaller batch can fix `exc`: real OOMs only (see `is_oom`).

    Illegal memory accesses, device-side asserts, channels_last rank errors, shape and dtype errors are never
    retried: a smaller batch cannot fix them, and after the first two the device is unusable anyway.
    """
    if any(fatal in _message(err) for err in _exception_chain(exc) for fatal in FATAL_MESSAGES):
        return False
    return is_oom(exc, cpu_capped)

