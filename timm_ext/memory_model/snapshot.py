"""A predicted memory snapshot: the replayed step in the format of `torch.cuda.memory._snapshot()`.

PyTorch's own tools read it before the GPU exists: `python -m torch.cuda._memory_viz stats|segments|trace|trace_plot|
segment_plot s.pickle`, or the memory_viz page (https://pytorch.org/memory_viz). The segments and blocks are the
allocator's state at the step's peak of allocated memory; `device_traces` holds every alloc, free and segment event
of the replay, each with frames naming the op, the module (or the autograd node of the backward) and the category.
Where matplotlib is installed, `write_plot` draws memory over the replay: allocated by category, reserved, and the
memory the allocator may use.
"""
import pickle
from typing import Dict, List, Optional

from .allocator import CachingAllocator, Segment
from .replay import ReplayConfig, replay

__all__ = ['predicted_snapshot', 'write_snapshot', 'write_plot']


def _frames(tag) -> List[dict]:
    if not tag:
        return []
    category, op, where = tag
    return [dict(filename=where, line=0, name=op), dict(filename='category', line=0, name=category)]


def _segment(segment: Segment, expandable: bool) -> dict:
    blocks = [dict(address=b.address, size=b.size, requested_size=b.requested if b.live else 0,
                   state='active_allocated' if b.live else 'inactive', frames=_frames(b.tag)) for b in segment.blocks]
    allocated = sum(b.size for b in segment.blocks if b.live)
    return dict(device=0, address=segment.address, total_size=segment.size, allocated_size=allocated,
                active_size=allocated, requested_size=sum(b['requested_size'] for b in blocks), stream=0,
                segment_type='small' if segment.small else 'large', segment_pool_id=(0, 0),
                is_expandable=expandable, frames=[], blocks=blocks)


class _PeakState(CachingAllocator):
    """An allocator that copies its segments whenever allocated memory reaches a new peak."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.at_peak: List[dict] = []
        self.reserved_at_peak = 0

    def malloc(self, nbytes: int, tag: object = None):
        block = super().malloc(nbytes, tag)
        if self.allocated >= self.peak_allocated:
            self.at_peak = [_segment(s, self.expandable) for s in self.segments if s.blocks]
            self.reserved_at_peak = self.reserved
        return block


def predicted_snapshot(log: dict, capacity: int, config: ReplayConfig = ReplayConfig()) -> Dict:
    """The snapshot of `log` replayed in `capacity` bytes (the least memory it runs in, say).

    Returns:
        `torch.cuda.memory._snapshot()`'s dict (segments at the peak, device_traces, allocator_settings), plus
        'predicted': the peak figures (reserved at the peak, peak allocated, peak reserved, capacity).

    Raises:
        OutOfMemory: The step does not run in `capacity`.
    """
    allocator = replay(log, capacity, config, record=True, allocator_type=_PeakState)
    trace = [dict(action=e['action'], addr=e['addr'], size=e['size'], stream=0, time_us=i, frames=_frames(e['tag']),
                  **({'device_free': capacity - allocator.reserved} if e['action'] == 'oom' else {}))
             for i, e in enumerate(allocator.trace)]
    return dict(segments=allocator.at_peak, device_traces=[trace],
                allocator_settings=dict(
                    PYTORCH_CUDA_ALLOC_CONF=f'expandable_segments:{config.allocator.expandable_segments}'),
                predicted=dict(reserved_at_peak=allocator.reserved_at_peak, peak_allocated=allocator.peak_allocated,
                               peak_reserved=allocator.peak_reserved, capacity=capacity))


def write_snapshot(snapshot: Dict, path: str) -> None:
    with open(path, 'wb') as f:
        pickle.dump(snapshot, f)


def write_plot(snapshot: Dict, path: str, title: str = '') -> Optional[str]:
    """A PNG of memory over the replay (allocated by category, reserved, capacity); None where matplotlib is not
    installed, else the path written."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    live: Dict[int, tuple] = {}  # address -> (category, size)
    by_category: Dict[str, int] = {}
    series: Dict[str, List[int]] = {}
    reserved, reserved_series = 0, []
    for i, e in enumerate(snapshot['device_traces'][0]):
        if e['action'] == 'alloc':
            category = e['frames'][1]['name'] if len(e['frames']) > 1 else 'other'
            live[e['addr']] = category, e['size']
            by_category[category] = by_category.get(category, 0) + e['size']
        elif e['action'] == 'free_completed' and e['addr'] in live:
            category, size = live.pop(e['addr'])
            by_category[category] -= size
        elif e['action'] in ('segment_alloc', 'segment_map'):
            reserved += e['size']
        elif e['action'] in ('segment_free', 'segment_unmap'):
            reserved -= e['size']
        for name in set(series) | set(by_category):
            series.setdefault(name, [0] * i).append(by_category.get(name, 0))
        reserved_series.append(reserved)
    gib = float(1 << 30)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    names = sorted(series, key=lambda n: -max(series[n]))
    ax.stackplot(range(len(reserved_series)), *[[v / gib for v in series[n]] for n in names], labels=names, alpha=0.8)
    ax.plot([v / gib for v in reserved_series], color='black', lw=1, label='reserved (segments)')
    ax.axhline(snapshot['predicted']['capacity'] / gib, color='red', ls='--', lw=1, label='allocator capacity')
    ax.set_xlabel('allocator event')
    ax.set_ylabel('GiB')
    ax.set_title(title or 'predicted CUDA memory over the replayed steps')
    ax.legend(loc='upper left', fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def save_predicted_snapshot(log: dict, capacity: int, config: ReplayConfig, path: str, describe: str) -> List[str]:
    """Write the snapshot of `log` replayed in `capacity` bytes to `path` (and its PNG beside it, `path` with .png);
    the report's lines.

    Raises:
        OSError: A file cannot be written.
    """
    from .allocator import OutOfMemory
    from ..memory import format_bytes
    try:
        snapshot = predicted_snapshot(log, capacity, config)
    except OutOfMemory:
        return [f'Memory snapshot: not written, the step runs out of memory in {format_bytes(capacity)}.']
    write_snapshot(snapshot, path)
    figures = snapshot['predicted']
    lines = [f'Memory snapshot (predicted, {describe}): {path}; at the peak {format_bytes(figures["peak_allocated"])} '
             f'allocated in {format_bytes(figures["reserved_at_peak"])} of segments, of {format_bytes(capacity)}; '
             f'open it with `python -m torch.cuda._memory_viz stats {path}` or at https://pytorch.org/memory_viz.']
    plot = write_plot(snapshot, path.rsplit('.', 1)[0] + '.png', describe)
    if plot:
        lines.append(f'Memory over the step: {plot}')
    return lines


def add_snapshot_argument(group) -> None:
    """validate.py's and tune_batch.py's `--memory-snapshot` (one definition for both)."""
    group.add_argument('--memory-snapshot', default=None, metavar='PATH',
                       help='with --estimate on --device cuda: write the predicted memory snapshot of one step at the '
                            'planned batch (torch.cuda.memory._snapshot() format, for python -m '
                            'torch.cuda._memory_viz or pytorch.org/memory_viz) to PATH, and a PNG beside it')


def snapshot_flag_problem(memory_snapshot: Optional[str], estimate: bool, device: str) -> Optional[str]:
    """A one-line complaint about --memory-snapshot as given, or None."""
    import os
    if memory_snapshot is None:
        return None
    if not estimate:
        return '--memory-snapshot writes the estimate\'s predicted snapshot: add --estimate'
    if not device.startswith('cuda'):
        return f'--memory-snapshot predicts CUDA memory, not {device}: add --device cuda'
    folder = os.path.dirname(os.path.abspath(memory_snapshot))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        return f'--memory-snapshot {memory_snapshot}: the folder {folder} does not exist or cannot be written'
    return None
