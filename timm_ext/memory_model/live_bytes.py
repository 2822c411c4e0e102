"""Count the bytes a training step holds, op by op, without running it for real (fake tensors).

`LiveBytes` is a dispatch mode: every tensor storage an op creates is counted from its creation until Python frees
it, in one of these categories, and the peak of their sum is kept with the split at that moment:

* weights: parameters and buffers (counted once, up front: they exist before the step);
* gradients: the `.grad` of each parameter, from the moment autograd stores it;
* buckets: DDP's gradient buckets, the reducer's copy of the gradients (`timm_ext.train.ddp_buckets`);
* optimizer: what `optimizer.step()` creates (momentum, Adam's moments);
* activations: what the forward pass creates (what autograd saves for the backward, the outputs);
* temporaries: what the backward creates that is not a gradient, and everything else;
* allocator: what the device's allocator hands out beyond the bytes asked for (`allocated`);
* library: what a kernel library keeps between ops once an op asked for it (`kept`: NNPACK's workspace);
* workspace: what the op running at the peak needs for itself (`workspace`).

Under a `FakeTensorMode` nothing is allocated, so this traces a step of any size in the time of its Python.
What a device adds to the tensors is the caller's: `allocated` maps a storage made by an op to the bytes the
device's allocator would hand out for it, and `workspace` says how many bytes an op needs for itself while it runs
(counted in the peak at that op, then released).
"""
import weakref
from typing import Callable, Dict, Iterable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..train.ddp_buckets import buckets_being_allocated

__all__ = ['CATEGORIES', 'LiveBytes', 'TraceMode']

CATEGORIES = ('weights', 'gradients', 'buckets', 'optimizer', 'activations', 'temporaries', 'allocator', 'library',
              'workspace')


class TraceMode(TorchDispatchMode):
    """A dispatch mode of the trace that sees what torch.compile's graphs run, not what compiling them runs.

    TorchDynamo runs a function eagerly while any dispatch mode on the stack does not ignore compile internals; with
    this, it compiles with the mode off and runs the compiled graphs with it on.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class LiveBytes(TraceMode):
    """Live bytes by category while the mode is active, and their peak.

    Args:
        params: The model's parameters (their gradients are re-filed under 'gradients' when autograd stores them).
        weights: Tensors that exist before the step (parameters, buffers, an EMA copy): counted as 'weights'.
        allocated: The bytes the device's allocator hands out for n bytes made by an op, given (the op and its
            args, or None and () for the weights; n) (default: n).
        workspace: Bytes an op needs for itself while it runs, given (op, args, its result) (default: none).
        kept: Bytes a library keeps from an op on, given (op, args, its result); the largest ask stays (default:
            none).
    """

    def __init__(self, params: Iterable[torch.Tensor], weights: Iterable[torch.Tensor] = (),
                 allocated: Callable[[object, tuple, int], int] = lambda func, args, n: n,
                 workspace: Optional[Callable[[object, tuple, object], int]] = None,
                 kept: Optional[Callable[[object, tuple, object], int]] = None):
        super().__init__()
        self.kept = kept
        self.allocated = allocated
        self.workspace = workspace
        self.live: Dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak: Dict[str, int] = dict(self.live)
        self._files: Dict[int, list] = {}  # id(storage) -> [category, bytes, the allocator's bytes beyond them]
        self._in_optimizer = False
        self.filing = True  # off while a compiled kernel computes what inductor never writes to memory
        self._handles = []
        for tensor in weights:
            self._file(tensor, 'weights', None, ())
        self.reset_peak()
        for p in params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_stored))
        self._handles += [register_optimizer_step_pre_hook(self._optimizer_starts),
                          register_optimizer_step_post_hook(self._optimizer_ends)]

    @property
    def peak_total(self) -> int:
        return sum(self.peak.values())

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (after a warm-up step, say)."""
        self.peak = dict(self.live)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _optimizer_starts(self, *_) -> None:
        self._in_optimizer = True

    def _optimizer_ends(self, *_) -> None:
        self._in_optimizer = False

    def _grad_stored(self, param: torch.Tensor) -> None:
        entry = self._files.get(id(param.grad.untyped_storage()))
        if entry is not None and entry[0] != 'gradients':
            self.live[entry[0]] -= entry[1]
            self.live['gradients'] += entry[1]
            entry[0] = 'gradients'

    def _file(self, tensor: torch.Tensor, category: str, func, args: tuple) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._files or not self.filing:
            return
        nbytes = storage.nbytes()
        entry = [category, nbytes, self.allocated(func, args, nbytes) - nbytes]
        self._files[key] = entry
        self.live[category] += nbytes
        self.live['allocator'] += entry[2]
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        category, nbytes, beyond = self._files.pop(key)
        self.live[category] -= nbytes
        self.live['allocator'] -= beyond

    def _category(self) -> str:
        if buckets_being_allocated():
            return 'buckets'
        if self._in_optimizer:
            return 'optimizer'
        return 'temporaries' if torch._C._current_graph_task_id() != -1 else 'activations'

    def _note_peak(self, extra: int = 0) -> None:
        if sum(self.live.values()) + extra > self.peak_total:
            self.peak = {**self.live, 'workspace': extra}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        category = self._category()
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._file(tensor, category, func, args)
        if self.kept is not None:
            self.live['library'] = max(self.live['library'], self.kept(func, args, out))
        self._note_peak(self.workspace(func, args, out) if self.workspace is not None else 0)
        return out
