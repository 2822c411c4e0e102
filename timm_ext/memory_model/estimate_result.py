"""What a memory estimate answers: the peak of a batch by category, the largest batch under a limit, the table.

`MemoryEstimate` holds a traced step (`timm_ext.memory_model.estimate`): on CUDA its replay on the caching allocator
(`timm_ext.memory_model.predict.CudaReplay`) is the answer; on the CPU the traced peaks' lines per category.
"""
import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import TimmExtError
from ..memory import format_bytes
from .devices import DeviceModel
from .kernel_limits import launch_limit
from .predict import CudaReplay, run_config
from .replay import ReplayConfig

__all__ = ['EstimateError', 'MemoryEstimate']


class EstimateError(TimmExtError):
    """The step cannot be traced on fake tensors; the message says why, in one line."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak memory of one training update, by category, as lines in the batch size.

    Attributes:
        lines: Category -> (bytes at batch 0, bytes per sample), fitted to the traced peaks.
        traced: Batch size -> the traced peak's split by category (what the lines were fitted to).
        device: What the device adds, and which categories its budget counts.
        describe: The model, input, precision and optimizer traced.
        seconds: Wall time the estimate took (build and trace).
        grad_bytes: The gradients' bytes on the device: resident through every micro-batch but the first of an
            accumulation window (`accumulating`).
        kernel_sizes: CUDA: per sample, the sizes that bound the batch whatever the memory
            (`timm_ext.memory_model.kernel_limits`).
        replay: CUDA: the step's event log on the caching allocator (`timm_ext.memory_model`), which answers `peak`
            and `largest_batch`, at any batch (None off CUDA: the lines answer).
        flops_per_sample: The traced update's FLOPs per sample (`torch.utils.flop_counter`'s formulas, at the
            largest batch, recomputed forwards included; 0 for a forward-only step).
        weight_storages: (bytes, role) of each storage the weights category counts, in the order the trace filed
            them (on CUDA the log's first residents), role 'trainable', 'ema' or 'fixed'
            (`timm_ext.memory_model.step_facts.weight_storages`; the savers priced by a rule read it).
        unmodelled: What of a compiled step the trace does not model (`timm_ext.memory_model.compiled_step`).
        compiled_by: How a compiled step's graphs were made (`compiled_step.generated_by`; '' when not compiled).
    """
    lines: Dict[str, Tuple[float, float]]
    traced: Dict[int, Dict[str, int]]
    device: DeviceModel
    describe: str
    seconds: float
    grad_bytes: int = 0
    kernel_sizes: Dict[str, float] = dataclasses.field(default_factory=dict)
    replay: Optional[CudaReplay] = None
    flops_per_sample: float = 0.0
    weight_storages: List[Tuple[int, str]] = dataclasses.field(default_factory=list)
    unmodelled: List[str] = dataclasses.field(default_factory=list)
    compiled_by: str = ''

    def to_json(self) -> dict:
        """The estimate as JSON's types (what a trace's child sends back and the benchmarks cache), device aside."""
        return dict(lines=self.lines, traced=self.traced, describe=self.describe, seconds=self.seconds,
                    grad_bytes=self.grad_bytes, kernel_sizes=self.kernel_sizes,
                    log=self.replay.log if self.replay else None, flops_per_sample=self.flops_per_sample,
                    weight_storages=self.weight_storages, unmodelled=self.unmodelled,
                    compiled_by=self.compiled_by)

    @classmethod
    def from_json(cls, data: dict, device: DeviceModel,
                  replay_config: Optional[ReplayConfig] = None) -> 'MemoryEstimate':
        """The estimate `to_json` wrote, for `device`; its replay runs as `replay_config` says (default: as the
        environment asks, on the device's card, `run_config`)."""
        replay = None
        if data.get('log'):
            replay = CudaReplay(data['log'], replay_config or run_config(device.compute_capability, device.software))
        return cls({name: tuple(line) for name, line in data['lines'].items()},
                   {int(b): split for b, split in data['traced'].items()}, device, data['describe'], data['seconds'],
                   data['grad_bytes'], data.get('kernel_sizes', {}), replay, data.get('flops_per_sample', 0.0),
                   [tuple(storage) for storage in data.get('weight_storages', [])], data.get('unmodelled', []),
                   data.get('compiled_by', ''))

    def categories(self, batch_size: int, accumulating: bool = False) -> Dict[str, float]:
        """Predicted bytes of each category at the peak, the device's fixed categories included.

        On CUDA the replay is the answer: the allocated blocks by category at the replay's peak, and 'segments', what
        the least memory the step runs in holds beyond them (free blocks of its segments). Elsewhere (and for an
        estimate without a replay) the fitted lines.

        Args:
            batch_size: The micro-batch.
            accumulating: A micro-batch after the first of an accumulation window: all gradients are resident
                from its start (the trace's update begins without them).
        """
        if self.replay is not None:
            return self.device.on_device(self.replay.split(batch_size, accumulating))
        # unclipped: the lines add up to the line of the traced peak (least squares is linear), whichever category
        # the peak's moment moves between as the batch grows
        split = {name: a + b * batch_size for name, (a, b) in self.lines.items()}
        if accumulating:  # the traced peak may hold some gradients already: the rest comes on top
            split['gradients'] += max(0.0, self.grad_bytes - split['gradients'])
        return self.device.on_device(split)

    def peak(self, batch_size: int, accumulating: bool = False) -> float:
        """Predicted peak in the budget's units (CPU: above what the process held before the step)."""
        return self.device.counted(self.categories(batch_size, accumulating))

    def line(self, accumulating: bool = False) -> Tuple[float, float]:
        """The predicted peak as (bytes at batch 0, bytes per sample): a prior for the probe's search."""
        low, high = (min(self.traced), max(self.traced)) if self.replay is not None else (0, 1)
        at_low, at_high = self.peak(low, accumulating), self.peak(high, accumulating)
        per_sample = (at_high - at_low) / (high - low)
        if per_sample <= 0 and self.replay is not None:  # a small step's growth can hide inside its 2 MiB segments
            per_sample = self.device.counted({name: b for name, (_, b) in self.lines.items()})
        return at_low - per_sample * low, per_sample

    def largest_batch(self, limit: float, accumulating: bool = False) -> int:
        """The largest batch predicted at or under `limit` bytes (0 when not even 1 is) that the device's kernels
        can launch (`launch_limit`)."""
        at_zero, per_sample = self.line(accumulating)
        if per_sample <= 0:
            raise EstimateError('the traced peak does not grow with the batch size; the estimate cannot aim')
        by_memory = max(0, int((limit - at_zero) // per_sample))
        if self.replay is not None:  # the line aims the replay's search
            return self.replay.largest_batch(limit, max(1, by_memory), accumulating, self.launch_limit[0])
        return min(by_memory, self.launch_limit[0] or by_memory)

    @property
    def replay_note(self) -> str:
        """How the CUDA replay read the step at other batches ('' where one scaled log answers every batch)."""
        if self.replay is None or self.replay.aligned:
            return ''
        return (f'the step\'s logs at two batch sizes did not line up event by event, so each batch asked was traced '
                f'on its own ({len(self.replay.traced_batches)} traced: {self.replay.traced_batches})')

    @property
    def notes(self) -> List[str]:
        """The plan's lines on how the step was read: the replay's, and how a compiled step's graphs were made and
        what of them is not modelled."""
        compiled = [self.compiled_by] if self.compiled_by else []
        compiled += [f'not modelled: {"; ".join(self.unmodelled)}'] if self.unmodelled else []
        return ([f'Replay: {self.replay_note}.'] if self.replay_note else []) + \
            ([f'Compiled step: {"; ".join(compiled)}.'] if compiled else [])

    @property
    def launch_limit(self) -> Tuple[Optional[int], str]:
        """The largest batch the device's kernels can launch whatever the memory, and why (None: no limit)."""
        return launch_limit(self.kernel_sizes, self.device.software, self.device.compute_capability)

    def table(self, batch_sizes: Sequence[int], budget: Optional[int] = None) -> List[str]:
        """The per-batch table: predicted peak by category, the total, and its share of `budget`."""
        splits = {b: self.categories(b) for b in batch_sizes}
        names = [n for n in dict.fromkeys(n for split in splits.values() for n in split)
                 if any(split.get(n, 0) for split in splits.values())]
        head = f'{"batch":>7s} ' + ' '.join(f'{n:>12s}' for n in names) + f' {"peak":>11s}'
        rows = [head + ('  of budget' if budget else '')]
        for b, split in splits.items():
            counted = self.device.counted(split)
            share = f'  {counted / budget:9.0%}' if budget else ''
            rows.append(f'{b:>7d} ' + ' '.join(f'{format_bytes(max(0.0, split.get(n, 0))):>12s}' for n in names)
                        + f' {format_bytes(counted):>11s}' + share)
        return rows
