"""The predicted memory snapshot, read as PyTorch's tools read a real one.

Each rule names the PyTorch source it was read from. The viewer's reading is `memory_viz_port` (a port of the
memory_viz page's MemoryViz.js); torch's own `torch.cuda._memory_viz` (2.14.1, installed) runs on the written files.
"""
import pickle
import pickletools
import re
import runpy
import sys
import warnings

from conftest import script_in_process
from memory_viz_port import allocator_state, annotate, process_alloc_data
from timm_ext.memory_model.allocator import CachingAllocator
from timm_ext.memory_model.allocator_config import parse_allocator_conf
from timm_ext.memory_model.replay import ReplayConfig
from timm_ext.memory_model.snapshot import predicted_snapshot, write_snapshot

MiB = 1 << 20
NAMES = ['activations', 'convolution', 'layer1', 'weights', 'model']
ONE_STEP = ReplayConfig(iterations=1, cudnn_benchmark=False)


def step(*events, residents=()) -> dict:
    """A step log (`timm_ext.memory_model.events.step_log`'s format): ('a', bytes) allocates an activation of
    layer1, ('f', n) frees the step's n-th allocation."""
    return dict(names=NAMES, residents=[[nbytes, 3, 3, 4] for nbytes in residents],
                events=[['a', e[1], 0, 1, 2] if e[0] == 'a' else list(e) for e in events])


# a weight, then a peak of three activations, then frees after the peak and a smaller allocation
FREED_AFTER_THE_PEAK = step(('a', 30 * MiB + 100), ('a', 3 * MiB + 7), ('a', 700), ('f', 0), ('a', 5 * MiB + 1),
                            ('f', 1), residents=[MiB + 3])


def read_by_the_page(snapshot: dict) -> dict:
    """What the memory_viz page shows of `snapshot`: its timelines and the allocator state at the replay's peak."""
    page = annotate(snapshot)
    figures = snapshot['predicted']  # the page lists the annotated events; time_us is an event's index in the file
    peak = next(i for i, e in enumerate(page['device_traces'][0]) if e['time_us'] == figures['peak_event'])
    return dict(timeline=process_alloc_data(page), segments=process_alloc_data(page, plot_segments=True),
                at_peak=allocator_state(page, peak)[:2], before=allocator_state(page, -1)[:2])


def test_the_segments_are_the_state_at_the_end_of_the_trace():
    """torch/cuda/memory.py `_snapshot`: the segments are the state when it is called, after the last event of its
    trace; MemoryViz.js `process_alloc_data` draws an active block that no alloc of the trace still holds as allocated
    before the trace and never freed. Segments copied at the peak would show the block freed after it that way."""
    snapshot = predicted_snapshot(FREED_AFTER_THE_PEAK, 1 << 30, ONE_STEP)
    active = [b for s in snapshot['segments'] for b in s['blocks'] if b['state'] == 'active_allocated']
    assert sorted(b['requested_size'] for b in active) == [700, MiB + 3, 5 * MiB + 1]
    assert read_by_the_page(snapshot)['timeline']['before_trace'] == []


def test_the_page_shows_the_replays_peak():
    """MemoryViz.js `process_alloc_data` (the Active Memory Timeline's top: the most bytes alive, counted as the
    trace's events give them), its segment timeline (the most reserved), and `simulate_memory` (the allocator state
    at the peak's event): the replay's peak, requested and reserved, and an empty allocator before the trace."""
    snapshot = predicted_snapshot(FREED_AFTER_THE_PEAK, 1 << 30, ONE_STEP)
    figures, page = snapshot['predicted'], read_by_the_page(snapshot)
    requested = MiB + 3 + 30 * MiB + 100 + 3 * MiB + 7 + 700
    assert figures['peak_requested'] == figures['requested_at_peak'] == requested
    assert page['timeline']['max_size'] == requested
    assert page['segments']['max_size'] == figures['peak_reserved'] == (20 + 32 + 2) * MiB  # the resident's segment,
    # the 30 MiB block's (rounded to 2 MiB) and the small pool's
    assert page['at_peak'] == (figures['reserved_at_peak'], requested)
    assert page['before'] == (0, 0)


def test_alloc_and_free_events_carry_the_requested_size():
    """c10/cuda/CUDACachingAllocator.cpp: `alloc_found_block` records ALLOC with `orig_size`, `free` records
    FREE_REQUESTED and `free_block` FREE_COMPLETED with `block->requested_size`, not the rounded block size."""
    allocator = CachingAllocator(1 << 30, record=True)
    block = allocator.malloc(700)
    assert block.size == 1024
    allocator.free(block)
    assert [(e['action'], e['size']) for e in allocator.trace] == [
        ('segment_alloc', 2 * MiB), ('alloc', 700), ('free_requested', 700), ('free_completed', 700)]


def test_a_segment_event_has_the_frames_of_the_allocation_it_was_made_for():
    """CUDACachingAllocator.cpp `alloc_block` records SEGMENT_ALLOC with the context of the malloc it serves."""
    trace = predicted_snapshot(step(('a', 3 * MiB)), 1 << 30, ONE_STEP)['device_traces'][0]
    assert [e['action'] for e in trace] == ['segment_alloc', 'alloc']
    assert trace[0]['frames'] == trace[1]['frames'] and trace[1]['frames'][0]['name'] == 'convolution'


# expandable segments, 20 MiB pages, 100 MiB of capacity: four pages, the first and third freed, then 30 MiB that fit
# only once those two are unmapped, then 25 MiB from inside the last mapped page into a new one
PAGES = step(*[('a', 20 * MiB)] * 4, ('f', 0), ('f', 2), ('a', 30 * MiB), ('a', 25 * MiB))
EXPANDABLE = ReplayConfig(iterations=1, cudnn_benchmark=False,
                          allocator=parse_allocator_conf('expandable_segments:True', 'PYTORCH_CUDA_ALLOC_CONF'))


def test_expandable_segments_map_and_unmap_one_contiguous_range_per_event():
    """CUDACachingAllocator.cpp: `map_block` records SEGMENT_MAP with the range it mapped (`mapped_range.ptr`, its
    size), `unmap_block` SEGMENT_UNMAP with the range of whole free pages it unmapped, one free block each."""
    snapshot = predicted_snapshot(PAGES, 100 * MiB, EXPANDABLE)
    trace = snapshot['device_traces'][0]
    base = trace[0]['addr']
    pages = [(e['action'], (e['addr'] - base) // MiB, e['size'] // MiB) for e in trace if 'map' in e['action']]
    assert pages == [('segment_map', 0, 20), ('segment_map', 20, 20), ('segment_map', 40, 20), ('segment_map', 60, 20),
                     ('segment_unmap', 0, 20), ('segment_unmap', 40, 20), ('segment_map', 80, 40),
                     ('segment_map', 120, 20)]  # the last: page 6 only, page 5 was mapped


def test_an_expandable_segment_is_listed_as_one_segment_per_mapped_range():
    """CUDACachingAllocator.cpp `DeviceCachingAllocator::snapshot`: "for expandable segments, we report one segment
    for each contiguous mapped range of memory", its blocks the mapped ones; MemoryViz.js `simulate_memory` then
    undoes each map and unmap inside those segments, back to nothing before the trace."""
    snapshot = predicted_snapshot(PAGES, 100 * MiB, EXPANDABLE)
    base = snapshot['device_traces'][0][0]['addr']
    assert [((s['address'] - base) // MiB, s['total_size'] // MiB, s['is_expandable']) for s in snapshot['segments']] \
        == [(20, 20, True), (60, 80, True)]
    page = annotate(snapshot)
    for index in range(-1, len(page['device_traces'][0])):
        allocator_state(page, index)  # raises where the page would throw or drop a segment
    assert allocator_state(page, -1)[:2] == (0, 0)


def test_blocks_tile_their_segment_from_its_address():
    """torch/csrc/cuda/memory_snapshot.cpp `segmentInfoToDict`: a block's address is its segment's plus the sizes of
    the blocks before it (MemoryViz.js `annotate_snapshot` computes it so); `snapshot()`: allocated_size sums the
    allocated blocks' sizes, requested_size the active blocks' requested sizes."""
    for log, capacity, config in ((FREED_AFTER_THE_PEAK, 1 << 30, ONE_STEP), (PAGES, 100 * MiB, EXPANDABLE)):
        for segment in predicted_snapshot(log, capacity, config)['segments']:
            blocks = segment['blocks']
            assert [b['address'] for b in blocks] == [segment['address'] + sum(b['size'] for b in blocks[:i])
                                                      for i in range(len(blocks))]
            assert sum(b['size'] for b in blocks) == segment['total_size']
            live = [b for b in blocks if b['state'] == 'active_allocated']
            assert segment['allocated_size'] == segment['active_size'] == sum(b['size'] for b in live)
            assert segment['requested_size'] == sum(b['requested_size'] for b in live)


def test_the_allocator_settings_have_the_keys_torch_writes():
    """torch/csrc/cuda/memory_snapshot.cpp `_memory_snapshot_pickled` (and the strings of 2.14.1's
    libtorch_python.so): allocator_settings' keys, roundup_power2_divisions keyed "1" to "32768"."""
    settings = predicted_snapshot(step(('a', 512)), 1 << 30, EXPANDABLE)['allocator_settings']
    assert set(settings) == {'PYTORCH_CUDA_ALLOC_CONF', 'max_split_size', 'garbage_collection_threshold',
                             'expandable_segments', 'pinned_num_register_threads', 'release_lock_on_cudamalloc',
                             'pinned_use_cuda_host_register', 'graph_capture_record_stream_reuse',
                             'roundup_power2_divisions'}
    assert settings['expandable_segments'] and settings['PYTORCH_CUDA_ALLOC_CONF'] == 'expandable_segments:True'
    assert list(settings['roundup_power2_divisions']) == [str(1 << i) for i in range(16)]


# the opcodes MemoryViz.js `unpickle` reads (protocols 2 to 4); any other one throws "UNKNOWN OPCODE"
PAGE_OPCODES = {'PROTO', 'APPEND', 'APPENDS', 'LIST', 'TUPLE', 'NEWFALSE', 'NEWTRUE', 'NONE', 'BINGET', 'BININT',
                'BININT1', 'BININT2', 'EMPTY_DICT', 'EMPTY_LIST', 'FRAME', 'LONG1', 'LONG_BINGET', 'MARK', 'MEMOIZE',
                'BINPUT', 'LONG_BINPUT', 'SETITEMS', 'SETITEM', 'DICT', 'SHORT_BINUNICODE', 'BINUNICODE', 'STOP',
                'EMPTY_TUPLE', 'TUPLE1', 'TUPLE2', 'TUPLE3', 'BINFLOAT'}


def test_the_file_is_one_the_page_can_unpickle(tmp_path):
    """MemoryViz.js `unpickle`: protocol 2 to 4 ("Unhandled version" otherwise) and only the opcodes it knows."""
    path = tmp_path / 's.pickle'
    write_snapshot(predicted_snapshot(PAGES, 100 * MiB, EXPANDABLE), str(path))
    ops = list(pickletools.genops(path.read_bytes()))
    assert ops[0][0].name == 'PROTO' and 2 <= ops[0][1] <= 4
    assert {op.name for op, _, _ in ops} <= PAGE_OPCODES


def read_by_torch(path, home, monkeypatch, capsys) -> dict:
    """`python -m torch.cuda._memory_viz stats|trace|segments PATH`'s outputs (runpy runs the module as -m does;
    `segments` renders with flamegraph.pl, which it downloads on first use: here a stand-in that echoes)."""
    script = home / '.cache' / 'flamegraph.pl'
    script.parent.mkdir(exist_ok=True)
    script.write_text('#!/bin/sh\ncat\n')
    script.chmod(0o755)
    monkeypatch.setenv('HOME', str(home))
    outputs = {}
    for action, *extra in (('stats',), ('trace',), ('segments', '-o', str(home / 'segments.txt'))):
        monkeypatch.setattr(sys, 'argv', ['_memory_viz', action, str(path), *extra])
        with warnings.catch_warnings():  # runpy's note that torch.cuda imported the module already
            warnings.simplefilter('ignore', RuntimeWarning)
            runpy.run_module('torch.cuda._memory_viz', run_name='__main__', alter_sys=True)
        outputs[action] = capsys.readouterr().out
    outputs['segments'] = (home / 'segments.txt').read_text()
    return outputs


def assert_read_as_written(path, home, monkeypatch, capsys) -> None:
    """The page and torch's `_memory_viz` read the file as a real one: no block the trace freed drawn as never freed,
    the replay's peak at the top of the timeline, and every free matched by an alloc of the trace."""
    snapshot = pickle.loads(path.read_bytes())
    figures, page = snapshot['predicted'], read_by_the_page(snapshot)
    assert page['timeline']['before_trace'] == []
    assert page['timeline']['max_size'] == figures['peak_requested'] <= figures['peak_allocated']
    assert page['at_peak'] == (figures['reserved_at_peak'], figures['requested_at_peak']) and page['before'] == (0, 0)
    if not snapshot['allocator_settings']['expandable_segments']:
        assert page['segments']['max_size'] == figures['peak_reserved']
    torch_read = read_by_torch(path, home, monkeypatch, capsys)
    assert f'segments: {len(snapshot["segments"])}' in torch_read['stats']
    assert re.search(r'^Device 0 -+\n\d+ entries\n', torch_read['trace'])
    assert not re.search(r'^del \d|free completed for \d', torch_read['trace'], re.M)  # a free of no alloc: its address
    assert 'active_allocated' in torch_read['segments']


def test_validate_writes_a_snapshot_the_viewer_reads_as_written(tmp_path, monkeypatch, capsys):
    path = tmp_path / 's.pickle'
    monkeypatch.chdir(tmp_path)
    done = script_in_process('validate.py', '--model', 'test_vit', '--device', 'cuda', '--mem-budget', '2GiB',
                             '--estimate', '--memory-snapshot', path)
    assert done.returncode == 0, done.stderr
    assert 'Memory snapshot (predicted' in done.stdout and '--memory-snapshot' not in done.stdout.split('command:')[1]
    assert_read_as_written(path, tmp_path, monkeypatch, capsys)
    assert (tmp_path / 's.png').stat().st_size > 10_000  # matplotlib is in the test requirements


def test_tune_batch_writes_a_snapshot_the_viewer_reads_as_written(tmp_path, monkeypatch, capsys):
    path = tmp_path / 't.pickle'
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv('PYTORCH_CUDA_ALLOC_CONF', 'expandable_segments:True')
    done = script_in_process('tune_batch.py', '--model', 'test_resnet', '--img-size', '32', '--num-classes', '3',
                             '--device', 'cuda', '--mem-budget', '2GiB', '--estimate', '--memory-snapshot', path)
    assert done.returncode == 0, done.stderr
    assert pickle.loads(path.read_bytes())['allocator_settings']['expandable_segments']
    assert_read_as_written(path, tmp_path, monkeypatch, capsys)


def test_a_snapshot_needs_the_estimate_and_a_cuda_device(tmp_path):
    without = script_in_process('validate.py', '--model', 'resnet18', '--device', 'cuda', '--memory-snapshot',
                                tmp_path / 's.pickle', '--data-dir', tmp_path)
    assert without.returncode != 0 and 'add --estimate' in without.stderr and 'Traceback' not in without.stderr
    cpu = script_in_process('tune_batch.py', '--model', 'resnet18', '--device', 'cpu', '--estimate',
                            '--memory-snapshot', tmp_path / 's.pickle')
    assert cpu.returncode != 0 and 'add --device cuda' in cpu.stderr and 'Traceback' not in cpu.stderr
    assert not (tmp_path / 's.pickle').exists()
