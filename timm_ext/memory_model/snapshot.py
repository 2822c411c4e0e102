"""A predicted memory snapshot: the replayed steps in the format of `torch.cuda.memory._snapshot()`.

PyTorch's own tools read it before the GPU exists: `python -m torch.cuda._memory_viz stats|segments|trace|trace_plot|
segment_plot s.pickle`, or the memory_viz page (https://pytorch.org/memory_viz). It is what recording the history
(`torch.cuda.memory._record_memory_history`) before the replayed steps and calling `_snapshot()` after them gives:
`device_traces` holds every alloc, free and segment event of the replay, and `segments` is the allocator's state at
the end of that trace. The page reads the two together (MemoryViz.js `process_alloc_data`): a block active in the
segments that no alloc of the trace still holds is drawn as allocated before the trace and never freed, so segments
copied at any other moment than the end of the trace would draw blocks that do not exist. The trace keeps the whole
replay, so the peak is in it: the Active Memory Timeline rises to it, and the Allocator State History stepped to the
peak's alloc event (its `time_us` is `predicted['peak_event']`) shows the segments then.

As torch writes them (c10/cuda/CUDACachingAllocator.cpp, `record_trace` calls): alloc, free_requested and
free_completed events carry the size the caller asked for (`requested_size`), segment events the segment's (or, with
expandable segments, one mapped or unmapped range's) address and size. Each event has frames naming the op, the
module (or the autograd node of the backward) and the category; a segment event has those of the allocation that made
it. Where matplotlib is installed, `write_plot` draws memory over the replay: requested by category, reserved, and the
memory the allocator may use.
"""
import pickle
from typing import Dict, List, Optional, Tuple

from .allocator import CachingAllocator, Segment, page_runs
from .allocator_config import DIVISION_INTERVALS, NO_LIMIT
from .replay import ReplayConfig, replay

__all__ = ['predicted_snapshot', 'write_snapshot', 'write_plot']

PICKLE_PROTOCOL = 4  # the memory_viz page's unpickler (MemoryViz.js `unpickle`) reads protocols 2 to 4 only


def _frames(tag) -> List[dict]:
    """A (category, op, module) tag as frames, innermost first: the op, then its category."""
    if not tag:
        return []
    category, op, where = tag
    return [dict(filename=where, line=0, name=op), dict(filename='category', line=0, name=category)]


def _ranges(segment: Segment, page: Optional[int]) -> List[Tuple[int, int]]:
    """The address ranges `snapshot()` reports as segments: the whole segment, or with expandable segments each
    contiguous mapped range ("one segment for each contiguous mapped range of memory")."""
    if page is None:
        return [(segment.address, segment.address + segment.size)]
    return [(segment.address + first * page, segment.address + end * page) for first, end in page_runs(segment.mapped)]


def _segments(segment: Segment, page: Optional[int], frames_at: Dict[int, list]) -> List[dict]:
    """`segment` as `_snapshot()` lists it (torch/csrc/cuda/memory_snapshot.cpp, `segmentInfoToDict`): each block's
    address is the segment's plus the sizes before it. A free block has no frames (`free_block` drops its context) and
    requested size 0 (torch keeps the last one, which no reader of a snapshot uses)."""
    dicts = []
    for start, end in _ranges(segment, page):
        blocks = []
        for b in segment.blocks:  # a free block of an expandable segment may span unmapped pages: only its mapped part
            low, high = max(b.address, start), min(b.address + b.size, end)
            if low < high:
                blocks.append(dict(address=low, size=high - low, requested_size=b.requested if b.live else 0,
                                   state='active_allocated' if b.live else 'inactive',
                                   frames=_frames(b.tag) if b.live else []))
        allocated = sum(b['size'] for b in blocks if b['state'] == 'active_allocated')
        dicts.append(dict(device=0, address=start, total_size=end - start, allocated_size=allocated,
                          active_size=allocated, requested_size=sum(b['requested_size'] for b in blocks), stream=0,
                          segment_type='small' if segment.small else 'large', segment_pool_id=(0, 0),
                          is_expandable=page is not None, frames=frames_at.get(start, []), blocks=blocks))
    return dicts


def _trace(events: List[dict]) -> List[dict]:
    """The allocator's events as `_snapshot()`'s trace entries; a segment_alloc or segment_map gets the frames of the
    allocation it was made for (the alloc that follows it), a segment_free those of its segment_alloc; an oom carries
    the device's free memory where others carry an address (torch/csrc/cuda/memory_snapshot.cpp, `device_free`)."""
    trace = [dict(action=e['action'], size=e['size'], stream=0, time_us=i, frames=_frames(e['tag']),
                  **({'device_free': e['addr']} if e['action'] == 'oom' else {'addr': e['addr']}))
             for i, e in enumerate(events)]
    following: List[dict] = []
    for entry in reversed(trace):
        if entry['action'] == 'alloc':
            following = entry['frames']
        elif entry['action'] in ('segment_alloc', 'segment_map'):
            entry['frames'] = following
    made_by: Dict[int, list] = {}
    for entry in trace:
        if entry['action'] == 'segment_alloc':
            made_by[entry['addr']] = entry['frames']
        elif entry['action'] == 'segment_free':
            entry['frames'] = made_by.get(entry['addr'], [])
    return trace


def _allocator_settings(config: ReplayConfig) -> dict:
    """`_snapshot()`'s allocator_settings for the options the replay ran with (c10/cuda/CUDAAllocatorConfig.cpp's
    names; an unlimited max_split_size is SIZE_MAX written as an int64, -1)."""
    options = config.allocator
    return {'PYTORCH_CUDA_ALLOC_CONF': options.text,
            'max_split_size': -1 if options.max_split_size == NO_LIMIT else options.max_split_size,
            'garbage_collection_threshold': options.garbage_collection_threshold,
            'expandable_segments': options.expandable_segments,
            'pinned_num_register_threads': 1, 'release_lock_on_cudamalloc': False,
            'pinned_use_cuda_host_register': False, 'graph_capture_record_stream_reuse': False,
            'roundup_power2_divisions': {str(1 << i): n for i, n in enumerate(options.roundup_power2_divisions)}}


class _Recorder(CachingAllocator):
    """An allocator that also counts the bytes asked for (torch's `requested_bytes`) and notes the trace event at
    which allocated memory first reaches its peak, with what was reserved and requested then."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requested = self.peak_requested = 0
        self.at_peak = dict(event=0, reserved=0, requested=0)

    def malloc(self, nbytes: int, tag: object = None):
        peak = self.peak_allocated
        block = super().malloc(nbytes, tag)
        self.requested += nbytes
        self.peak_requested = max(self.peak_requested, self.requested)
        if self.allocated > peak:
            self.at_peak = dict(event=len(self.trace) - 1, reserved=self.reserved, requested=self.requested)
        return block

    def free(self, block) -> None:
        self.requested -= block.requested
        super().free(block)


def predicted_snapshot(log: dict, capacity: int, config: ReplayConfig = ReplayConfig()) -> Dict:
    """The snapshot of `log` replayed `config.iterations` times in `capacity` bytes (the least memory it runs in, say).

    Returns:
        `torch.cuda.memory._snapshot()`'s dict (segments at the end of the trace, device_traces, allocator_settings),
        plus 'predicted': peak_allocated, peak_requested (the top of the memory_viz timeline), peak_reserved,
        peak_event (the index in device_traces[0], and time_us, of the event at which allocated memory first peaks),
        reserved_at_peak and requested_at_peak (after that event), and capacity.

    Raises:
        OutOfMemory: The step does not run in `capacity`.
    """
    allocator = replay(log, capacity, config, record=True, allocator_type=_Recorder)
    trace = _trace(allocator.trace)
    frames_at = {e['addr']: e['frames'] for e in trace if e['action'] in ('segment_alloc', 'segment_map')}
    expandable = config.allocator.expandable_segments
    segments = sorted((d for s in allocator.segments
                       for d in _segments(s, allocator.page_size(s.small) if expandable else None, frames_at)),
                      key=lambda d: d['address'])
    peak = allocator.at_peak
    return dict(segments=segments, device_traces=[trace], allocator_settings=_allocator_settings(config),
                predicted=dict(peak_allocated=allocator.peak_allocated, peak_requested=allocator.peak_requested,
                               peak_reserved=allocator.peak_reserved, peak_event=peak['event'],
                               reserved_at_peak=peak['reserved'], requested_at_peak=peak['requested'],
                               capacity=capacity))


def write_snapshot(snapshot: Dict, path: str) -> None:
    with open(path, 'wb') as f:
        pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL)


def write_plot(snapshot: Dict, path: str, title: str = '') -> Optional[str]:
    """A PNG of memory over the replay (requested by category, reserved, capacity); None where matplotlib is not
    installed, else the path written."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    live: Dict[int, tuple] = {}  # address -> (category, requested size)
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
             f'allocated ({format_bytes(figures["requested_at_peak"])} requested) in '
             f'{format_bytes(figures["reserved_at_peak"])} of segments, of {format_bytes(capacity)}; its segments are '
             f'those after the last of the {config.iterations} steps replayed, as _snapshot() gives them; open it with '
             f'`python -m torch.cuda._memory_viz stats {path}` or at https://pytorch.org/memory_viz.']
    plot = write_plot(snapshot, path.rsplit('.', 1)[0] + '.png', describe)
    if plot:
        lines.append(f'Memory over the steps: {plot}')
    return lines


def add_snapshot_argument(group) -> None:
    """validate.py's and tune_batch.py's `--memory-snapshot` (one definition for both)."""
    group.add_argument('--memory-snapshot', default=None, metavar='PATH',
                       help='with --estimate on --device cuda: write the predicted memory snapshot of the steps at the '
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
