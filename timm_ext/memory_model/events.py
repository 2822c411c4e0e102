"""The ordered log of a traced step: every allocation and free, with its size, category, op and module.

`EventLog` is `timm_ext.memory_model.live_bytes.LiveBytes` (the same categories and peaks) that also writes down, in
execution order, each storage an op creates (`['a', bytes, category, op, module]`), each one Python frees (`['f',
key]`), and for the ops whose CUDA kernels allocate differently from the CPU kernels the trace ran, their shapes
(`['o', signature, module, *numbers]`, read by `timm_ext.memory_model.kernels`). Strings are interned in `names`.

`step_log` cuts one step out of the log: what was live before it and stays (`residents`), its events with keys
numbered within the step, and the frees of what the step before left (`['p', category, op, module, rank]`: the
rank-th allocation of that signature in the previous step), so that a replay can repeat the step. `ScaledLog` lines
up the logs of two batch sizes event by event and gives the log at any batch, each number linear in the batch.
"""
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from .kernels import describe_op
from .live_bytes import LiveBytes

__all__ = ['EventLog', 'step_log', 'ScaledLog', 'AlignmentError']


class AlignmentError(ValueError):
    """The logs of two batch sizes do not line up event by event."""


class EventLog(LiveBytes):
    """`LiveBytes` that also keeps the ordered event log (see the module doc).

    Args:
        params, weights: As `LiveBytes`.
        modules: The traced model's modules by qualified name (the forward's ops are filed under the innermost);
            None: the ops are filed under 'step' (a compiled model's graphs run outside its modules).
    """

    def __init__(self, params: Iterable[torch.Tensor], weights: Iterable[torch.Tensor] = (),
                 modules: Optional[Dict[str, torch.nn.Module]] = None, **kwargs):
        self.events: List[list] = []
        self.names: List[str] = []
        self._name_index: Dict[str, int] = {}
        self._keys: Dict[int, int] = {}  # id(storage) -> its allocation's index in `events`
        self._module_names = {id(m): n or 'model' for n, m in (modules or {}).items()}
        self._module_stack: List[str] = []
        self._op = 'weights'
        super().__init__(params, weights, **kwargs)
        if modules is not None:  # none for a compiled model: TorchDynamo would break its graphs at the hooks
            self._handles += [torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
                              torch.nn.modules.module.register_module_forward_hook(self._leave)]

    def name(self, text: str) -> int:
        if text not in self._name_index:
            self._name_index[text] = len(self.names)
            self.names.append(text)
        return self._name_index[text]

    def _enter(self, module, *_) -> None:
        self._module_stack.append(self._module_names.get(id(module), type(module).__name__))

    def _leave(self, *_) -> None:
        if self._module_stack:
            self._module_stack.pop()

    def _where(self) -> int:
        node = torch._C._current_autograd_node()
        if node is not None:  # the backward: the autograd node that runs the op
            return self.name(f'backward {node.name()}')
        return self.name(self._module_stack[-1] if self._module_stack else 'step')

    def _file(self, tensor: torch.Tensor, category: str, func, args: tuple) -> None:
        key = id(tensor.untyped_storage())
        known = key in self._files
        super()._file(tensor, category, func, args)
        if not known and key in self._files:
            self._keys[key] = len(self.events)
            self.events.append(['a', self._files[key][1], self.name(category), self.name(self._op), self._where()])

    def _freed(self, key: int) -> None:
        super()._freed(key)
        self.events.append(['f', self._keys.pop(key)])

    def _grad_stored(self, param: torch.Tensor) -> None:
        super()._grad_stored(param)
        index = self._keys.get(id(param.grad.untyped_storage()))
        if index is not None:
            self.events[index][2] = self.name('gradients')

    def mark(self) -> int:
        """The position in the log now (a step's boundary)."""
        return len(self.events)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._op = str(func).removeprefix('aten.')
        out = super().__torch_dispatch__(func, types, args, kwargs)
        described = describe_op(func, args, out, kwargs)
        if described is not None:
            signature, numbers = described
            self.events.append(['o', self.name(signature), self._where(), *numbers])
        self._op = 'step'
        return out


def step_log(events: Sequence[list], names: Sequence[str], start: int, end: int, previous: int) -> dict:
    """One step of an `EventLog`: events[start:end], the step before it being events[previous:start].

    Returns:
        A JSON-able dict: `residents` (bytes, category, op, module of what was live at the start and stays), `events`
        (keys numbered within the step) and `names`.
    """
    allocated_before = {}  # index in events -> signature, for what the previous step allocated
    ranks: Dict[tuple, int] = {}
    for i in range(previous, start):
        if events[i][0] == 'a':
            signature = tuple(events[i][2:5])
            allocated_before[i] = (*signature, ranks.get(signature, 0))
            ranks[signature] = ranks.get(signature, 0) + 1
    freed_here = {e[1] for e in events[start:end] if e[0] == 'f'}
    freed_before = {e[1] for e in events[:start] if e[0] == 'f'}
    residents = [events[i][1:5] for i in range(start) if events[i][0] == 'a' and i not in freed_before
                 and i not in freed_here]
    local: Dict[int, int] = {}
    step = []
    for i in range(start, end):
        event = events[i]
        if event[0] == 'a':
            local[i] = len(local)
            step.append(list(event))
        elif event[0] == 'f':
            if event[1] in local:
                step.append(['f', local[event[1]]])
            elif event[1] in allocated_before:
                step.append(['p', *allocated_before[event[1]]])
        else:
            step.append(list(event))
    return dict(residents=residents, events=step, names=list(names))


class ScaledLog:
    """The logs of one step at two batch sizes, lined up: the log at any batch, each number linear in the batch.

    Raises:
        AlignmentError: The two logs differ in an event's kind, key, category, op or module, or in their lengths.
    """

    def __init__(self, low: dict, low_batch: int, high: dict, high_batch: int):
        self.names = low['names']
        self.low_batch, self.high_batch = low_batch, high_batch
        self.residents = self._pair(low['residents'], high['residents'], 'residents', number_at=0)
        self.events = self._pair(low['events'], high['events'], 'events', number_at=None)

    @staticmethod
    def _pair(low: List[list], high: List[list], what: str, number_at: Optional[int]) -> List[tuple]:
        if len(low) != len(high):
            raise AlignmentError(f'{what}: {len(low)} against {len(high)}')
        pairs = []
        for i, (a, b) in enumerate(zip(low, high)):
            # which fields are numbers that scale: a resident's bytes; an allocation's bytes; an op's shapes
            scaled = (0,) if number_at == 0 else (1,) if a[0] == 'a' else tuple(range(3, len(a))) if a[0] == 'o' else ()
            fixed_a = [v for j, v in enumerate(a) if j not in scaled]
            fixed_b = [v for j, v in enumerate(b) if j not in scaled]
            if fixed_a != fixed_b or len(a) != len(b):
                raise AlignmentError(f'{what} {i}: {a} against {b}')
            pairs.append((a, b, scaled))
        return pairs

    def at(self, batch: int) -> dict:
        """The step's log at `batch` (a `step_log` dict; numbers rounded, at least 0)."""
        t = (batch - self.low_batch) / (self.high_batch - self.low_batch)

        def scale(a: list, b: list, scaled: tuple) -> list:
            return [max(0, round(v + (b[j] - v) * t)) if j in scaled else v for j, v in enumerate(a)]
        return dict(residents=[scale(*r) for r in self.residents], events=[scale(*e) for e in self.events],
                    names=self.names)

    def to_json(self) -> dict:
        return dict(low=dict(residents=[r[0] for r in self.residents], events=[e[0] for e in self.events],
                             names=self.names), low_batch=self.low_batch,
                    high=dict(residents=[r[1] for r in self.residents], events=[e[1] for e in self.events],
                              names=self.names), high_batch=self.high_batch)

    @classmethod
    def from_json(cls, data: dict) -> 'ScaledLog':
        return cls(data['low'], data['low_batch'], data['high'], data['high_batch'])
