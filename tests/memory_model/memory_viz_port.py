"""A Python port of how PyTorch's memory_viz page reads a snapshot, to check a snapshot the way the page draws it.

Ported by reading torch/utils/viz/MemoryViz.js (pytorch/pytorch, commit 00067369c9339bed950762afec327514d6fa2566;
torch 2.14.1 ships no copy of the page: `torch.cuda._memory_viz.trace_plot` writes HTML that loads it from the
pytorch repository). Written afresh, not copied; each function names the JS function it follows:

* `annotate` follows `annotate_snapshot`: a `free_requested` directly followed by the `free_completed` of the same
  address becomes one `free` event, and each segment's blocks get the address `addr` the page gives them: the
  segment's address plus the sizes of the blocks before it (the page never reads a block's own `address`).
* `process_alloc_data` follows `process_alloc_data`, the Active Memory Timeline (and, with `plot_segments`, the Active
  Cached Segment Timeline): which elements it draws, which it draws as allocated before the trace and never freed, and
  the stacked total at each step, whose largest value is the top of the plot (`max_size`). The polygons' geometry is
  left out: it changes no number.
* `allocator_state` follows `MemoryView.simulate_memory` and `draw`, the Allocator State History: the segments and
  blocks after a trace event, found by undoing the later events from the snapshot's segments, and the (reserved,
  allocated) pair the page prints above the event. Where the page would silently misdraw or throw (a segment event
  outside every segment, a block in no segment), the port raises `ViewerMismatch` instead.
"""
from typing import Dict, List, Tuple

__all__ = ['ViewerMismatch', 'annotate', 'process_alloc_data', 'allocator_state']


class ViewerMismatch(AssertionError):
    """The page would throw or draw something other than the allocator's state."""


def annotate(snapshot: dict) -> dict:
    """`annotate_snapshot`'s changes that the numbers depend on, on a copy of `snapshot`."""
    traces = []
    for device_trace in snapshot['device_traces']:
        trace: List[dict] = []
        for event in device_trace:
            event = {'frames': [], **event}
            if event['action'] == 'free_completed' and trace and trace[-1]['action'] == 'free_requested' \
                    and trace[-1]['addr'] == event['addr']:
                trace[-1]['action'] = 'free'
                continue
            trace.append(event)
        traces.append(trace)
    segments = []
    for segment in snapshot['segments']:
        addr, blocks = segment['address'], []
        for block in segment['blocks']:
            blocks.append({**block, 'addr': addr})
            addr += block['size']
        segments.append({**segment, 'blocks': blocks})
    return {**snapshot, 'device_traces': traces, 'segments': segments}


def _elements(snapshot: dict, device: int, plot_segments: bool) -> Tuple[list, list, list]:
    """The first part of `process_alloc_data`: (elements, indices of those allocated before the trace, actions)."""
    elements, before, actions, addr_to_alloc = [], [], [], {}
    alloc = 'segment_alloc' if plot_segments else 'alloc'
    frees = ('segment_free',) if plot_segments else ('free', 'free_completed')
    for event in snapshot['device_traces'][device]:
        if event['action'] == alloc:
            elements.append(event)
            addr_to_alloc[event['addr']] = len(elements) - 1
            actions.append(len(elements) - 1)
        elif event['action'] in frees:
            if event['addr'] in addr_to_alloc:
                actions.append(addr_to_alloc.pop(event['addr']))
            else:  # freed, never allocated in the trace: drawn as allocated before it
                elements.append(event)
                before.append(len(elements) - 1)
                actions.append(len(elements) - 1)
    for segment in snapshot['segments']:
        if segment['device'] != device:
            continue
        if plot_segments:
            if segment['address'] not in addr_to_alloc:
                elements.append(dict(action='alloc', addr=segment['address'], size=segment['total_size']))
                before.append(len(elements) - 1)
            continue
        for block in segment['blocks']:  # active now, yet no alloc of the trace still holds it: allocated before it
            if block['state'] == 'active_allocated' and block['addr'] not in addr_to_alloc:
                elements.append(dict(action='alloc', addr=block['addr'], size=block['requested_size']))
                before.append(len(elements) - 1)
    before.reverse()
    if not actions and before:
        actions.append(before.pop())
    return elements, before, actions


def process_alloc_data(snapshot: dict, device: int = 0, plot_segments: bool = False, max_entries: int = 15000) -> dict:
    """The Active Memory Timeline's numbers for an `annotate`d snapshot.

    Returns:
        'max_size': the top of the plot (the largest stacked total); 'before_trace': the elements drawn as allocated
        before the trace; 'max_at_time': the stacked total at each step; 'elements': every element.
    """
    elements, before, actions = _elements(snapshot, device, plot_segments)
    order = sorted(range(len(elements)), key=lambda i: -elements[i]['size'])  # JS sort is stable too
    drawn = set(order[:max_entries])
    current: List[int] = []
    total = summarized_total = max_size = 0
    summarized: Dict[int, bool] = {}
    max_at_time: List[int] = []
    for elem in before:
        if elem in drawn:
            current.append(elem)
            total += elements[elem]['size']
        else:
            summarized_total += elements[elem]['size']
            summarized[elem] = True
    for elem in actions:
        size = elements[elem]['size']
        if elem not in drawn:  # the page skips max_size here, as it does
            if elem in summarized:
                max_at_time.append(total + summarized_total)
                summarized_total -= size
            else:
                summarized_total += size
                summarized[elem] = True
                max_at_time.append(total + summarized_total)
            continue
        if elem not in current:
            current.append(elem)
            total += size
            max_at_time.append(total + summarized_total)
        else:
            max_at_time.append(total + summarized_total)
            at = len(current) - 1 - current[::-1].index(elem)
            del current[at]
            if at < len(current):
                max_at_time += [total + summarized_total] * 3
            total -= size
        max_size = max(total + summarized_total, max_size)
    return dict(max_size=max_size, before_trace=[elements[i] for i in before], max_at_time=max_at_time,
                elements=elements)


def _map_segment(segments: List[dict], merge: bool, segment: dict) -> None:
    """`simulate_memory`'s `map_segment` (undoing a segment_free or segment_unmap)."""
    at = next((i for i, s in enumerate(segments) if s['addr'] > segment['addr']), -1)
    if not merge:
        segments.insert(max(len(segments) - 1, 0) if at == -1 else at, segment)  # JS splice(-1, 0, x)
        return
    at = len(segments) if at == -1 else at
    segments.insert(at, segment)
    if at + 1 < len(segments):
        after = segments[at + 1]
        if segment['addr'] + segment['size'] == after['addr'] and segment['stream'] == after['stream']:
            segment['size'] += after['size']
            del segments[at + 1]
    if at > 0:
        before = segments[at - 1]
        if before['addr'] + before['size'] == segment['addr'] and before['stream'] == segment['stream']:
            before['size'] += segment['size']
            del segments[at]


def _unmap_segment(segments: List[dict], merge: bool, segment: dict) -> None:
    """`simulate_memory`'s `unmap_segment` (undoing a segment_alloc or segment_map)."""
    end = segment['addr'] + segment['size']
    if not merge:
        at = next((i for i, s in enumerate(segments) if s['addr'] == segment['addr']), -1)
        if at == -1:
            raise ViewerMismatch(f'segment_alloc at {segment["addr"]:#x}: no such segment (the page drops another)')
        del segments[at]
        return
    at = next((i for i, s in enumerate(segments) if s['addr'] <= segment['addr'] and end <= s['addr'] + s['size']),
              -1)
    if at == -1:
        raise ViewerMismatch(f'segment_map [{segment["addr"]:#x}, {end:#x}) lies in no segment (the page throws)')
    existing = segments[at]
    existing_end = existing['addr'] + existing['size']
    if existing['addr'] == segment['addr']:
        existing['addr'] += segment['size']
        existing['size'] -= segment['size']
        if existing['size'] == 0:
            del segments[at]
    elif existing_end == end:
        existing['size'] -= segment['size']
    else:
        existing['size'] = segment['addr'] - existing['addr']
        segments.insert(at + 1, dict(segment, addr=end, size=existing_end - end))


def _undo(event: dict, segments: List[dict], blocks: Dict[int, dict]) -> None:
    action, addr = event['action'], event.get('addr')
    if action == 'free':
        blocks[addr] = dict(addr=addr, size=event['size'], requested_size=event['size'], free_requested=False)
    elif action == 'free_requested':
        if addr not in blocks:
            raise ViewerMismatch(f'free_requested of {addr:#x} after its block is gone (the page throws)')
        blocks[addr]['free_requested'] = False
    elif action == 'free_completed':
        blocks[addr] = dict(addr=addr, size=event['size'], requested_size=event['size'], free_requested=True)
    elif action == 'alloc':
        blocks.pop(addr, None)
    elif action in ('segment_free', 'segment_unmap'):
        _map_segment(segments, action == 'segment_unmap', dict(addr=addr, size=event['size'],
                                                                 stream=event.get('stream')))
    elif action in ('segment_alloc', 'segment_map'):
        _unmap_segment(segments, action == 'segment_map', dict(addr=addr, size=event['size'],
                                                                 stream=event.get('stream')))


def allocator_state(snapshot: dict, index: int, device: int = 0) -> Tuple[int, int, List[dict], List[dict]]:
    """The Allocator State History after trace event `index` of an `annotate`d snapshot.

    Returns:
        (reserved, allocated, segments, blocks) as the page computes them: reserved sums the segments, allocated the
        blocks' requested sizes.

    Raises:
        ViewerMismatch: A segment event or a block that the page cannot place.
    """
    segments, blocks = [], {}
    for segment in snapshot['segments']:
        if segment['device'] != device:
            continue
        segments.append(dict(addr=segment['address'], size=segment['total_size'], stream=segment['stream']))
        for block in segment['blocks']:
            if block['state'] in ('active_pending_free', 'active_allocated'):
                blocks[block['addr']] = dict(addr=block['addr'], size=block['size'],
                                             requested_size=block['requested_size'],
                                             free_requested=block['state'] == 'active_pending_free')
    segments.sort(key=lambda s: s['addr'])
    events = snapshot['device_traces'][device]
    for i in range(len(events) - 1, index, -1):
        _undo(events[i], segments, blocks)
    for block in blocks.values():
        if not any(s['addr'] <= block['addr'] < s['addr'] + s['size'] for s in segments):
            raise ViewerMismatch(f'block at {block["addr"]:#x} after event {index} is in no segment (the page throws)')
    return (sum(s['size'] for s in segments), sum(b['requested_size'] for b in blocks.values()), segments,
            list(blocks.values()))
