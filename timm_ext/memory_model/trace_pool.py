"""Several memory estimates at once: each traced in a forked child of its own, as many at a time as there are cores.

A trace is single-threaded Python (fake tensors, one op at a time), and each already runs in a child of its own
(`timm_ext.memory_model.estimate.in_child`), so on a machine with free cores the children can run side by side: the
answers are those of `estimate_memory` called one after another, in less wall time. Where this process traces in
itself (it has run a backward already, `timm_ext.child_process.fork_runs_autograd`), they run one after another: the
trace's hooks and modes are process-wide.
"""
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Sequence, Union

from ..child_process import fork_runs_autograd
from .estimate import EstimateError, MemoryEstimate, estimate_memory

__all__ = ['estimate_each']


def estimate_each(calls: Sequence[Dict]) -> List[Union[MemoryEstimate, EstimateError]]:
    """`estimate_memory(**call)` for each call, in order; a step that cannot be traced gives its `EstimateError`."""
    def one(call: Dict) -> Union[MemoryEstimate, EstimateError]:
        try:
            return estimate_memory(**call)
        except EstimateError as error:
            return error
    workers = min(len(calls), len(os.sched_getaffinity(0))) if fork_runs_autograd() else 1
    if workers <= 1:
        return [one(call) for call in calls]
    with ThreadPoolExecutor(workers, thread_name_prefix='trace') as pool:
        return list(pool.map(one, calls))
