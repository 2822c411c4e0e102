"""The global-batch rule on synthetic throughput and noise-scale tables: kept unless clearly sooner; guards."""
import math

import pytest

from timm_ext.tune.batch_choice import (
    GAIN_MARGIN, MIN_UPDATES, NoiseEstimate, batch_warnings, choose_global_batch, format_candidates,
    lengthened_epochs, scaled_schedule, statistical_efficiency, tuning_pays, updates_per_epoch,
)
from timm_ext.train.noise_scale import bootstrap_noise_scale


def noise(b: float, low: float = None, high: float = None) -> NoiseEstimate:
    return NoiseEstimate(b, low if low is not None else b, high if high is not None else b, 16, 2048, 1.0)


# 100k samples per epoch, 10 epochs: every candidate keeps thousands of updates unless a test shrinks the data
BIG = dict(world_size=1, train_samples=100_000, epochs=10)


def test_efficiency_follows_mccandlish():
    assert statistical_efficiency(128, 128, 50.0) == 1.0
    # (1 + 128/1000) / (1 + 512/1000)
    assert statistical_efficiency(512, 128, 1000.0) == pytest.approx(1.128 / 1.512)
    assert lengthened_epochs(8, 1.0) == 8 and lengthened_epochs(8, 0.78) == 11 and lengthened_epochs(8, 1.2) == 8


def test_updates_per_epoch_drops_the_last_partial_batch_and_rounds_windows_up():
    assert updates_per_epoch(1437, 128, 1, 1) == 11
    assert updates_per_epoch(1437, 32, 2, 4) == 6  # 718 per rank -> 22 batches -> ceil(22 / 4)
    assert updates_per_epoch(100, 128, 1, 1) == 0


def test_bigger_batch_chosen_when_much_faster_and_below_the_noise_scale():
    # 4x the samples/s at 512, B_noise 20k: efficiency ~0.98, so the bigger batch is ~3.9x sooner
    choice = choose_global_batch((128, 1), {128: 1000.0, 256: 2000.0, 512: 4000.0}, noise=noise(20_000), **BIG)
    assert choice.changed and choice.chosen.global_batch == 512
    assert choice.chosen.epochs == lengthened_epochs(10, choice.chosen.efficiency) == 11
    assert choice.chosen.predicted_s < choice.recipe.predicted_s * (1 - GAIN_MARGIN)
    assert 'sooner' in choice.reason


def test_flat_throughput_keeps_the_recipe():
    # the CPU case: samples/s barely moves with the batch, so no bigger batch can pay for the samples it wastes
    choice = choose_global_batch((128, 1), {128: 1000.0, 256: 1040.0, 512: 1050.0}, noise=noise(5_000), **BIG)
    assert not choice.changed and 'kept' in choice.reason
    assert [c.excluded for c in choice.candidates[1:]] == [f'not {GAIN_MARGIN:.0%} sooner'] * 2


def test_batch_above_the_noise_range_is_excluded_however_fast():
    choice = choose_global_batch((128, 1), {128: 1000.0, 1024: 20_000.0}, noise=noise(300, 200, 400), **BIG)
    assert not choice.changed and choice.candidates[1].excluded == 'above the B_noise range (400)'


def test_the_low_end_of_the_estimate_decides():
    # with B_noise 2000 a 2x faster 512 pays; with the low end 100 it wastes 3x the samples
    speeds = {128: 1000.0, 512: 2000.0}
    assert choose_global_batch((128, 1), speeds, noise=noise(2000, 2000, 4000), **BIG).changed
    cautious = choose_global_batch((128, 1), speeds, noise=noise(2000, 100, 4000), **BIG)
    assert not cautious.changed and cautious.candidates[1].efficiency == pytest.approx(2.28 / 6.12)


def test_too_few_updates_excludes_a_bigger_batch():
    choice = choose_global_batch((128, 1), {128: 1000.0, 1024: 8000.0}, world_size=1, train_samples=10_000,
                                 epochs=10, noise=noise(100_000))
    assert not choice.changed and choice.candidates[1].excluded.endswith(f'< {MIN_UPDATES}')


def test_without_a_noise_estimate_only_the_recipe_is_judged():
    for estimate in (None, noise(math.nan, math.nan, math.nan)):
        choice = choose_global_batch((128, 1), {128: 1000.0, 512: 9000.0}, noise=estimate, **BIG)
        assert not choice.changed and len(choice.candidates) == 1 and 'cannot be judged' in choice.reason


def test_accumulated_recipe_has_no_faster_bigger_batch():
    # the recipe's global batch 512 is already built as 64 x 8: no micro-batch above 512 fits, nothing to consider
    choice = choose_global_batch((64, 8), {32: 500.0, 64: 900.0}, noise=noise(10_000), **BIG)
    assert not choice.changed and len(choice.candidates) == 1 and choice.recipe.global_batch == 512


def test_ranks_multiply_the_candidates():
    choice = choose_global_batch((64, 1), {64: 1000.0, 256: 4000.0}, world_size=2, train_samples=100_000,
                                 epochs=10, noise=noise(50_000))
    assert choice.recipe.global_batch == 128 and choice.chosen.global_batch == 512


def test_schedule_stretches_with_the_run():
    values = {'epochs': 8, 'warmup_epochs': 1, 'decay_epochs': 90, 'cooldown_epochs': 0,
              'decay_milestones': [4, 6], 'sched': 'cosine'}
    assert scaled_schedule(values, 8, 8) == {}
    assert scaled_schedule(values, 8, 16) == {'epochs': 16, 'warmup_epochs': 2, 'decay_epochs': 180,
                                              'decay_milestones': [8, 12]}
    assert scaled_schedule({'warmup_epochs': 0.5}, 10, 15) == {'epochs': 15, 'warmup_epochs': 0.75}


def test_tuning_pays_only_on_long_runs():
    assert tuning_pays(predicted_run_s=600, tuning_cost_s=20) and not tuning_pays(predicted_run_s=20, tuning_cost_s=6)


def test_guard_warnings_name_the_consequence_and_the_flag():
    few = batch_warnings(1437, updates=8, noise=None)
    assert len(few) == 1 and '8 optimizer updates' in few[0] and '-b/--batch-size' in few[0]
    far = batch_warnings(4096, updates=10_000, noise=noise(300, 200, 400))
    assert len(far) == 1 and 'over 4x the measured B_noise (300)' in far[0] and '--select auto' in far[0]
    assert batch_warnings(128, updates=10_000, noise=noise(300)) == []


def test_candidate_table_marks_the_choice_and_the_exclusions():
    choice = choose_global_batch((128, 1), {128: 1000.0, 256: 1010.0, 512: 4000.0}, noise=noise(20_000), **BIG)
    table = format_candidates(choice)
    lines = table.splitlines()
    assert 'predicted' in lines[0] and len(lines) == 4
    assert lines[1].rstrip().endswith('recipe') and 'not 10% sooner' in lines[2] and lines[3].endswith('chosen')


def test_bootstrap_interval_brackets_the_ratio_of_means():
    # |G|² 1.0 and tr(Σ) 100 +- noise per window: B_simple 100, the interval around it
    windows = [(1.0 + 0.1 * ((i % 5) - 2), 100.0 + 10 * ((i % 3) - 1)) for i in range(30)]
    b, low, high = bootstrap_noise_scale(windows)
    assert b == pytest.approx(sum(w[1] for w in windows) / sum(w[0] for w in windows))
    assert low < b < high and high / low < 1.3


def test_bootstrap_of_noisy_windows_is_wide_or_not_positive():
    # |G|² swamped by noise: some resamples have a non-positive mean, so the high end is unbounded
    windows = [(g, 50.0) for g in (2.0, -1.9, 1.5, -1.4, 0.3, -0.2)]
    b, low, high = bootstrap_noise_scale(windows)
    assert math.isinf(high) or high / low > 10
    assert all(math.isnan(v) for v in bootstrap_noise_scale([]))


def test_probe_plot_is_written_with_both_panels(tmp_path):
    from timm_ext.probe.table import FIT, OOM, Trial
    from timm_ext.tune.plot import write_probe_plot
    trials = [Trial(64, FIT, peak_bytes=2 ** 27, ms_per_step=60.0, samples_per_s=1066.0, accepted=True),
              Trial(128, FIT, peak_bytes=2 ** 28, ms_per_step=110.0, samples_per_s=1163.0, accepted=True),
              Trial(256, OOM, error='DefaultCPUAllocator: can\'t allocate memory')]
    choice = choose_global_batch((64, 1), {64: 1066.0, 128: 2163.0}, noise=noise(20_000), **BIG)
    assert len(choice.candidates) == 2
    path = write_probe_plot(str(tmp_path / 'probe.png'), trials, 128, choice)
    assert path and (tmp_path / 'probe.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
