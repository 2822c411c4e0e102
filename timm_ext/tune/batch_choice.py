"""Choosing the global batch by the time it takes to reach the recipe's result.

The micro-batch is a hardware choice (what fits, what runs fastest); the global batch is an optimisation choice. A
fixed-epoch recipe is tuned for its own global batch B0, and a bigger one only pays if the extra samples/s outweigh
the samples it wastes. McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", section 2): reaching a
given loss at batch B takes `E = E_min (1 + B / B_noise)` samples, so a global batch G needs
`(1 + G / B_noise) / (1 + B0 / B_noise)` times the recipe's samples; its statistical efficiency is the inverse.
The time to the recipe's result is then samples needed / samples per second (goodput, as in Pollux, OSDI 2021), and
the run is lengthened by the inverse efficiency so it is expected to reach the same result.

The model is a guide, not a guarantee: on small data the number of updates and the limits of LR scaling bite first
(digits, 8 epochs: G=128 85.6% top-1, G=256 for 10 epochs 83.6%, G=512 for 15 epochs 41.7%). So the rules here are
conservative: the recipe's batch is kept unless a bigger one is predicted clearly sooner with the *low* end of the
B_noise estimate, stays within the estimate's range, and keeps enough updates. Everything here is pure.
"""
import math
import statistics
from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..accum import MIN_UPDATES

__all__ = [
    'MIN_UPDATES', 'NOISE_FACTOR', 'GAIN_MARGIN', 'MAX_TUNE_SHARE', 'NoiseEstimate', 'Candidate', 'GlobalBatchChoice',
    'updates_per_epoch', 'statistical_efficiency', 'lengthened_epochs', 'choose_global_batch', 'scaled_schedule',
    'batch_warnings', 'format_candidates', 'tuning_pays', 'speeds_by_micro_batch',
]

NOISE_FACTOR = 4  # a global batch above this many times the measured B_noise is warned about
GAIN_MARGIN = 0.10  # a bigger batch must be predicted this much sooner: one size's speed moves 3-9% between processes
MAX_TUNE_SHARE = 0.05  # the global-batch search (probe and estimate) may cost at most this share of the planned run


@dataclass(frozen=True)
class NoiseEstimate:
    """A measured gradient noise scale B_noise (B_simple), with its spread.

    Attributes:
        b_noise: tr(Σ) / |G|² over all windows (samples); nan when no positive estimate formed.
        low: 10th percentile of the bootstrap over windows.
        high: 90th percentile of the bootstrap over windows.
        windows: Accumulation windows measured.
        samples: Samples trained to measure it.
        seconds: Wall time of the measurement.
    """
    b_noise: float
    low: float
    high: float
    windows: int
    samples: int
    seconds: float

    @property
    def found(self) -> bool:
        return math.isfinite(self.low) and self.low > 0

    def describe(self) -> str:
        if not self.found:
            return (f'no positive B_noise from {self.windows} windows ({self.samples} samples, {self.seconds:.1f} s): '
                    f'the gradient noise swamped the signal')
        return (f'B_noise ≈ {self.b_noise:.0f} samples (10-90% of a bootstrap over {self.windows} windows: '
                f'{self.low:.0f}-{self.high:.0f}; {self.samples} samples, {self.seconds:.1f} s)')


@dataclass(frozen=True)
class Candidate:
    """One global batch considered, with what is predicted for it.

    Attributes:
        global_batch: micro_batch x world size x accum_steps.
        micro_batch: Per-rank batch.
        accum_steps: Accumulation steps.
        samples_per_s: Measured training speed at `micro_batch` (all ranks).
        efficiency: Samples the recipe needs / samples this batch needs for the same result (1.0 for the recipe).
        epochs: Epochs the run needs at this batch (the recipe's, lengthened by 1 / efficiency).
        updates: Optimizer updates in those epochs.
        predicted_s: Predicted compute time to the recipe's result (epochs x samples per epoch / samples_per_s).
        excluded: Why this batch may not be chosen ('' when it may).
    """
    global_batch: int
    micro_batch: int
    accum_steps: int
    samples_per_s: float
    efficiency: float
    epochs: int
    updates: int
    predicted_s: float
    excluded: str = ''


@dataclass(frozen=True)
class GlobalBatchChoice:
    """The candidates, the one chosen and why (one sentence)."""
    chosen: Candidate
    recipe: Candidate
    candidates: Tuple[Candidate, ...]
    reason: str

    @property
    def changed(self) -> bool:
        return self.chosen.global_batch != self.recipe.global_batch


def updates_per_epoch(train_samples: int, micro_batch: int, world_size: int, accum_steps: int) -> int:
    """Updates in one epoch: the training loader drops the last partial batch, windows are ceil(batches / accum)."""
    batches = (train_samples // world_size) // micro_batch
    return math.ceil(batches / accum_steps)


def statistical_efficiency(global_batch: int, recipe_batch: int, b_noise: float) -> float:
    """Samples the recipe's batch needs / samples `global_batch` needs for the same loss (McCandlish et al.)."""
    return (1 + recipe_batch / b_noise) / (1 + global_batch / b_noise)


def lengthened_epochs(epochs: int, efficiency: float) -> int:
    """Whole epochs that give at least the recipe's progress at `efficiency` (never fewer than the recipe's)."""
    return max(epochs, math.ceil(epochs / efficiency - 1e-9))


def _candidate(global_batch: int, micro: int, accum: int, speed: float, efficiency: float, epochs: int,
               train_samples: int, world_size: int) -> Candidate:
    run_epochs = lengthened_epochs(epochs, efficiency)
    updates = run_epochs * updates_per_epoch(train_samples, micro, world_size, accum)
    return Candidate(global_batch, micro, accum, speed, efficiency, run_epochs, updates,
                     run_epochs * train_samples / speed)


def choose_global_batch(recipe: Tuple[int, int], speeds: Mapping[int, float], world_size: int, train_samples: int,
                        epochs: int, noise: Optional[NoiseEstimate], min_updates: int = MIN_UPDATES,
                        margin: float = GAIN_MARGIN) -> GlobalBatchChoice:
    """The global batch with the shortest predicted time to the recipe's result; the recipe's unless one is clearly
    sooner.

    Bigger batches come from bigger micro-batches only: accumulation adds no samples/s, so a global batch above the
    recipe's built by accumulating would cost samples and buy nothing.

    Args:
        recipe: (micro-batch, accumulation) the recipe's global batch is built from (its speed must be measured).
        speeds: Measured samples/s (all ranks) per micro-batch that fits.
        world_size: Ranks.
        train_samples: Training samples per epoch.
        epochs: The recipe's epochs.
        noise: The B_noise estimate (None or not found: nothing but the recipe can be judged).
        min_updates: A bigger batch must keep at least this many updates.
        margin: A bigger batch must be predicted at least this fraction sooner than the recipe.
    """
    micro0, accum0 = recipe
    global0 = micro0 * world_size * accum0
    base = _candidate(global0, micro0, accum0, speeds[micro0], 1.0, epochs, train_samples, world_size)
    candidates: List[Candidate] = [base]
    if noise is None or not noise.found:
        why = 'no B_noise was measured' if noise is None else 'the noise-scale estimate was not positive'
        return GlobalBatchChoice(base, base, tuple(candidates), f'kept the recipe\'s global batch {global0}: {why}, '
                                                                f'so a bigger batch cannot be judged')
    for micro in sorted(m for m in speeds if m * world_size > global0):
        g = micro * world_size
        cand = _candidate(g, micro, 1, speeds[micro], statistical_efficiency(g, global0, noise.low), epochs,
                          train_samples, world_size)
        if g > noise.high:
            cand = replace(cand, excluded=f'above the B_noise range ({noise.high:.0f})')
        elif cand.updates < min_updates:
            cand = replace(cand, excluded=f'{cand.updates} updates < {min_updates}')
        elif cand.predicted_s > base.predicted_s * (1 - margin):
            cand = replace(cand, excluded=f'not {margin:.0%} sooner')
        candidates.append(cand)
    eligible = [c for c in candidates[1:] if not c.excluded]
    if not eligible:
        return GlobalBatchChoice(base, base, tuple(candidates),
                                 f'kept the recipe\'s global batch {global0}: no bigger batch is predicted '
                                 f'{margin:.0%} sooner within B_noise and {min_updates} updates')
    best = min(eligible, key=lambda c: c.predicted_s)
    gain = 1 - best.predicted_s / base.predicted_s
    return GlobalBatchChoice(best, base, tuple(candidates),
                             f'global batch {best.global_batch} is predicted to reach the recipe\'s result {gain:.0%} '
                             f'sooner ({best.samples_per_s:.0f} vs {base.samples_per_s:.0f} samples/s, efficiency '
                             f'{best.efficiency:.2f} at the low B_noise {noise.low:.0f}), over {best.epochs} epochs '
                             f'instead of {epochs}')


def tuning_pays(predicted_run_s: float, tuning_cost_s: float, share: float = MAX_TUNE_SHARE) -> bool:
    """Whether searching for a bigger global batch costs at most `share` of the planned run."""
    return tuning_cost_s <= share * predicted_run_s


# schedule keys in epochs that move with the run's length (stock train.py keys)
_EPOCH_KEYS = ('warmup_epochs', 'decay_epochs', 'cooldown_epochs')


def scaled_schedule(values: Mapping[str, object], epochs: int, new_epochs: int) -> Dict[str, object]:
    """The schedule keys of `values` stretched from `epochs` to `new_epochs`: the epochs, warm-up, decay and
    cool-down epochs and the decay milestones, so the schedule keeps its shape over the longer run."""
    if new_epochs == epochs:
        return {}
    factor = new_epochs / epochs
    scaled: Dict[str, object] = {'epochs': new_epochs}
    for key in _EPOCH_KEYS:
        value = values.get(key)
        if value:
            scaled[key] = type(value)(round(value * factor)) if isinstance(value, int) else value * factor
    milestones = values.get('decay_milestones')
    if milestones:
        scaled['decay_milestones'] = [round(m * factor) for m in milestones]
    return scaled


def batch_warnings(global_batch: int, updates: int, noise: Optional[NoiseEstimate],
                   min_updates: int = MIN_UPDATES) -> List[str]:
    """One-line warnings for a run whose batch may keep it from training to the recipe's accuracy."""
    warnings = []
    if updates < min_updates:
        warnings.append(f'global batch {global_batch} leaves the run only {updates} optimizer updates '
                        f'(< {min_updates}): fixed-epoch runs this short lose accuracy to smaller batches (digits, '
                        f'8 epochs: 88 updates at -b 128 gave 85.6% top-1, 352 at -b 32 90.0%); a smaller '
                        f'-b/--batch-size (or '
                        f'--target-global-batch) gives more updates')
    if noise is not None and noise.found and global_batch > NOISE_FACTOR * noise.high:
        warnings.append(f'global batch {global_batch} is over {NOISE_FACTOR}x the measured B_noise '
                        f'({noise.b_noise:.0f}): most of each batch buys no progress, so the run needs many more '
                        f'epochs for the same result; --select auto keeps the recipe\'s batch')
    return warnings


def format_candidates(choice: GlobalBatchChoice) -> str:
    """The candidates as a table: batch, split, samples/s, efficiency, epochs, updates, predicted time, verdict."""
    rows = [('global', 'micro x accum', 'samples/s', 'efficiency', 'epochs', 'updates', 'predicted', 'verdict')]
    for c in choice.candidates:
        verdict = 'chosen' if c == choice.chosen else 'recipe' if c == choice.recipe else c.excluded or 'slower'
        rows.append((str(c.global_batch), f'{c.micro_batch} x {c.accum_steps}', f'{c.samples_per_s:.0f}',
                     f'{c.efficiency:.2f}', str(c.epochs), str(c.updates), f'{c.predicted_s:.0f} s', verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return '\n'.join('  ' + '  '.join(v.rjust(w) for v, w in zip(r, widths)) for r in rows)


def speeds_by_micro_batch(trials: Sequence) -> Dict[int, float]:
    """The median samples/s of each accepted micro-batch in a probe's trial table."""
    timings: Dict[int, List[float]] = {}
    for t in trials:
        if t.accepted and t.samples_per_s:
            timings.setdefault(t.batch_size, []).append(t.samples_per_s)
    return {b: statistics.median(v) for b, v in timings.items()}
