"""The CUDA answer of an estimate (`timm_ext.memory_model.predict`): one answer, the replay, and a step whose logs at
two batch sizes do not line up read by tracing each batch the plan asks."""

from timm_ext.memory_model.devices import device_model
from timm_ext.memory_model.estimate import MemoryEstimate
from timm_ext.memory_model.live_bytes import CATEGORIES
from timm_ext.memory_model.predict import STEP_CATEGORIES, CudaReplay, trace_logs

MiB = 1 << 20


def _step(batch: int, extra_free: bool = False) -> dict:
    """A step log: 64 MiB of weights resident, then 30 MiB of activations a sample, a temporary, both freed; with
    `extra_free` an allocation more (a log that does not line up with one without it)."""
    names = ['weights', 'activations', 'temporaries', 'op', 'model']
    events = [['a', 30 * MiB * batch, 1, 3, 4], ['a', 12 * MiB, 2, 3, 4], ['f', 1], ['f', 0]]
    if extra_free:
        events += [['a', 4 * MiB, 2, 3, 4], ['f', 2]]
    return dict(residents=[[64 * MiB, 0, 3, 4]], events=events, names=names)


def test_the_logs_that_do_not_line_up_are_kept_as_traced():
    events = [['a', 1024, 0, 1, 1], ['f', 0], ['a', 1024, 0, 1, 1], ['a', 2048, 0, 1, 1], ['f', 2], ['f', 3]]
    steps, order = {16: (0, 2), 32: (2, 6)}, [(0, 2), (2, 6)]
    log = trace_logs(steps, events, ['temporaries', 'op'], order)
    assert sorted(log['traced']) == ['16', '32']


def test_a_step_whose_logs_do_not_line_up_traces_each_batch_asked():
    asked = []

    def retrace(batch: int) -> dict:
        asked.append(batch)
        return _step(batch, extra_free=batch % 2 == 1)

    replay = CudaReplay(dict(traced={'2': _step(2), '3': _step(3, True)}), retrace=retrace)
    assert not replay.aligned
    largest = replay.largest_batch(64 * MiB + 12 * MiB + 30 * MiB * 10, guess=4)
    assert largest == 10  # ten samples' activations fit beside the weights and the temporary, eleven do not
    assert asked and all(b not in (2, 3) for b in asked)  # the traced batches are read as they were traced
    assert replay.traced_batches == sorted({2, 3, *asked})


def test_the_replay_is_the_answer_and_its_split_adds_up_to_it():
    replay = CudaReplay(dict(traced={'4': _step(4), '8': _step(8)}))
    lines = {name: (0.0, 0.0) for name in CATEGORIES}
    device = device_model('cuda')
    estimate = MemoryEstimate(lines, {4: {}, 8: {}}, device, 'synthetic', 0.0, replay=replay)
    split = estimate.categories(8)
    assert estimate.peak(8) == replay.least_memory(8) == sum(split.values())
    assert split['weights'] == 64 * MiB and split['activations'] == 8 * 30 * MiB
    assert 'segments' in split and split['segments'] >= 0
    # every category a replay files, 0 where none holds bytes at the peak
    assert set(STEP_CATEGORIES) == {'weights', 'gradients', 'buckets', 'optimizer', 'activations', 'temporaries',
                                    'workspace'} and set(STEP_CATEGORIES) <= set(split)
    assert 'did not line up' in estimate.replay_note
