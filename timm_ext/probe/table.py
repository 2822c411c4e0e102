"""The trial table: one `Trial` for each batch size run for real, kept in the order run, and how it is shown.

A search, the re-timing rounds and the rank agreement all speak in trials: fit, OOM or another error, with the peak
memory and the speed of a fit. `record_trial` is the one place a trial joins a table (marked accepted or not, and
reported as it lands); `format_trial` is its log line and `trials_to_json` the table as a file. A probe that cannot
choose raises a `ProbeError` that carries the table so far.
"""
import json
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Sequence

from ..errors import TimmExtError
from ..memory import format_bytes

__all__ = ['FIT', 'OOM', 'ERROR', 'Trial', 'TrialFn', 'ProbeError', 'NothingFitsError', 'TrialError', 'record_trial',
           'format_trial', 'trials_to_json']

FIT, OOM, ERROR = 'fit', 'oom', 'error'


@dataclass
class Trial:
    """One batch size, tried for real.

    Attributes:
        batch_size: Samples per step (per rank).
        status: 'fit', 'oom' or 'error' (a failure that is not out-of-memory).
        peak_bytes: Peak memory of the step in the budget's units (see `timm_ext.memory.PeakMeter`); None if
            unknown or the step failed.
        ms_per_step: Wall time of one timed step in milliseconds (fits only).
        samples_per_s: batch_size / step time (x world size under DDP), fits only.
        error: One line naming the failure ('' for a fit).
        accepted: Set by the search: the trial fits and is within the headroom.
        retime: 0 for the search's trial of the size, k for its k-th re-timing round (`retime_trials`).
        compile_s: Seconds the trial spent in torch.compile (tracing, and compiling or loading graphs); None when it
            compiled nothing.
        graphs_compiled: Inductor graphs the trial compiled (None: it compiled nothing).
        graphs_loaded: Inductor graphs the trial loaded from the compile cache (None: it compiled nothing).
    """
    batch_size: int
    status: str
    peak_bytes: Optional[int] = None
    ms_per_step: Optional[float] = None
    samples_per_s: Optional[float] = None
    error: str = ''
    accepted: Optional[bool] = None
    retime: int = 0
    compile_s: Optional[float] = None
    graphs_compiled: Optional[int] = None
    graphs_loaded: Optional[int] = None

    @property
    def fits(self) -> bool:
        return self.status == FIT

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> 'Trial':
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


TrialFn = Callable[[int], Trial]


class ProbeError(TimmExtError):
    """The probe could not choose a batch size; the message is one line. `trials` holds the table so far."""

    def __init__(self, message: str, trials: Sequence[Trial] = ()):
        super().__init__(message)
        self.trials = list(trials)


class NothingFitsError(ProbeError):
    """Not even the smallest size fits the budget."""


class TrialError(ProbeError):
    """A trial failed with an error that is not out-of-memory; probing stopped there."""


def record_trial(trial: Trial, accept: Optional[Callable[[Trial], bool]], trials: List[Trial],
                 on_trial: Optional[Callable[[Trial], None]]) -> Trial:
    """Mark `trial` accepted or not, append it to the table and report it."""
    trial.accepted = trial.fits and bool(accept(trial) if accept is not None else True)
    trials.append(trial)
    if on_trial is not None:
        on_trial(trial)
    return trial


def format_trial(trial: Trial, budget: Optional[int] = None) -> str:
    """One log line for a trial, e.g. 'batch   64: fit   peak 1.20 GiB (60% of budget)  12.3 ms  5203.3 /s'."""
    head = f'batch {trial.batch_size:>6d}: {trial.status:<5s}'
    if not trial.fits:
        return f'{head} {trial.error}{_compile_note(trial)}'
    share = f' ({trial.peak_bytes / budget:.0%} of budget)' if budget and trial.peak_bytes is not None else ''
    note = '' if trial.accepted is not False else '  [over headroom]'
    note += f'  [re-timing {trial.retime}]' if trial.retime else ''
    speed = f'{trial.ms_per_step:.1f} ms/step, {trial.samples_per_s:.1f} samples/s' if trial.ms_per_step else ''
    return f'{head} peak {format_bytes(trial.peak_bytes)}{share}  {speed}{note}{_compile_note(trial)}'


def _compile_note(trial: Trial) -> str:
    """What a compiled trial spent compiling: graphs compiled and loaded from the cache, and the seconds."""
    if trial.compile_s is None:
        return ''
    return f'  [compile {trial.compile_s:.1f} s: {trial.graphs_compiled} graphs compiled, {trial.graphs_loaded} loaded]'


def trials_to_json(trials: Sequence[Trial], **meta) -> str:
    """The table (in the order run) and any metadata as a JSON document."""
    return json.dumps({**meta, 'trials': [t.to_dict() for t in trials]}, indent=2, sort_keys=False)
