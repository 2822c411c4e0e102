"""The CUDA context per card generation and software (`contexts.cuda_context`), and the capacities at the smallest figure
CUDA was seen to report."""
import pytest

from timm_ext.memory_model.cards import CARDS
from timm_ext.memory_model.contexts import (CONTEXT_MEASUREMENTS, MODULES_BYTES, MODULES_HIGH, MODULES_LOW,
                                            cuda_context, module_loading)
from timm_ext.memory_model.versions import PINNED, RELEASES, Software

GiB = 1 << 30
MiB = 1 << 20
TORCH_112 = RELEASES[0]  # torch 1.12.1 + CUDA 11.3: timm's RTX 3090 training table


@pytest.mark.parametrize('software, loading', [
    (TORCH_112, 'eager'),  # CUDA 11.3 has no lazy loading (it starts in 11.7)
    (Software((1, 12, 1), (11, 8), None), 'eager'),  # 11.7+, but torch sets CUDA_MODULE_LOADING only from 1.13
    (Software((1, 13, 0), (11, 7), None), 'lazy'),  # torch 1.13 sets it (pytorch/pytorch#86509)
    (Software((1, 12, 1), (12, 2), None), 'lazy'),  # CUDA 12.2's default on Linux
    (RELEASES[1], 'lazy'), (RELEASES[2], 'lazy'), (PINNED, 'lazy')])
def test_module_loading_follows_the_cuda_and_torch_versions(software, loading):
    """CUDA programming guide, 'Lazy Loading' (introduced 11.7, default from 12.2); torch 1.13's
    `_set_cuda_module_loading` (pytorch/pytorch#86509)."""
    assert module_loading(software) == loading


def test_every_measurement_names_its_source_and_loading():
    assert {m.loading for m in CONTEXT_MEASUREMENTS} == {'lazy', 'eager'}
    for m in CONTEXT_MEASUREMENTS:
        assert m.source.startswith('https://github.com/') and 200 * MiB < m.nbytes < 2 * GiB and m.what


def test_a_measured_generation_takes_its_own_largest_measurement_plus_the_modules():
    ada = cuda_context((8, 9), PINNED)  # RTX 6000 Ada, torch 2.10 + CUDA 13.0: 426 MiB bare
    assert ada.measured and ada.nbytes == 426 * MiB + MODULES_BYTES and 'unsloth-zoo/pull/1053' in ada.source
    ampere = cuda_context((8, 6), Software((1, 7, 1), (11, 0), None))  # RTX 3090, eager: 999 and 1486 MiB seen
    assert ampere.measured and ampere.nbytes == 1486 * MiB + MODULES_BYTES and 'issues/49877' in ampere.source
    assert ampere.nbytes > ada.nbytes  # eager loading loads every module at start


def test_a_measurement_of_the_runs_own_torch_and_cuda_comes_before_one_of_the_generation():
    """An eager context is every module of the libraries the release loads: torch 1.12.1 + CUDA 11.3's own 843 MiB
    (pytorch#86493) plans the RTX 3090 table's software, not the 1486 MiB of torch 1.7.1 + CUDA 11.0 on that card."""
    table = cuda_context((8, 6), TORCH_112)
    assert table.measured and table.nbytes == 843 * MiB + MODULES_BYTES and 'issues/86493' in table.source
    assert "with the run's torch and CUDA" in table.describe()


def test_an_unmeasured_generation_is_an_assumption_with_the_range_the_measurements_allow():
    hopper = cuda_context((9, 0), PINNED)
    lazy = [m.nbytes for m in CONTEXT_MEASUREMENTS if m.loading == 'lazy']
    assert not hopper.measured and hopper.nbytes == max(lazy) + MODULES_BYTES
    assert (hopper.low, hopper.high) == (min(lazy) + MODULES_LOW, max(lazy) + MODULES_HIGH)
    assert hopper.low < hopper.nbytes < hopper.high
    said = hopper.describe()
    assert 'an assumption, range 437.59 MiB-938.00 MiB' in said and 'none of 9.0 published' in said
    assert 'an assumption' not in cuda_context((8, 9), PINNED).describe()


def test_a_cards_allocator_memory_and_plan_follow_the_software():
    from timm_ext.memory import parse_budget
    card = CARDS['rtx3090']
    assert card.allocator_bytes == card.allocator_bytes_for(PINNED) == card.reported_bytes - card.context().nbytes
    assert card.allocator_bytes_for(TORCH_112) == card.reported_bytes - card.context(TORCH_112).nbytes
    assert card.allocator_bytes_for(TORCH_112) < card.allocator_bytes  # eager loading leaves the allocator less
    assert card.plan_in(parse_budget('1.0'), '1.0', software=TORCH_112)[1] == card.allocator_bytes_for(TORCH_112)
    assert 'eager loading, 8.6' in card.assumptions(TORCH_112) and 'issues/86493' in card.assumptions(TORCH_112)


@pytest.mark.parametrize('name, gib', [('h200', 139.72), ('a100-40gb', 39.25)])
def test_capacities_are_the_smallest_figure_cuda_was_seen_to_report(name, gib):
    """Issue 44: the H200 was seen at 139.72-139.81 GiB and the A100 40 GB at 39.25-39.50 GiB; the smallest is the
    safe side."""
    card = CARDS[name]
    assert card.reported_bytes == round(gib * GiB) and f'{gib:.2f} GiB' in card.reported_source
    assert 'smallest figure seen is kept' in card.note
