"""The default headroom of a CUDA plan made by the memory estimate, from the model's measured error.

The headroom is a margin around the model, never one of its rules: the share of the budget a plan leaves free so that
the batch it picks still fits where the model predicts too little. Its figure is measured, not chosen: for each
decayed row of timm's published GPU tables that calibrate the model (`bench/bench_gpu_tables.py`, each table replayed
with its own software), the least headroom at which the plan stays below the rung that ran out of memory; the default
is the `QUANTILE` of those over the rows (tune_batch.py's from the training table, validate.py's from the inference
tables). The bench writes them to `headroom.json` beside this module, with where they came from; a plan reads them here
and prints that origin.
"""
import json
import os
from dataclasses import dataclass
from functools import lru_cache

__all__ = ['Headroom', 'estimate_headroom', 'HEADROOM_FILE', 'QUANTILE', 'STEPS']

HEADROOM_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'headroom.json')
QUANTILE = 0.98  # the share of calibration rows whose plan the headroom keeps below the rung that failed
STEPS = ('train', 'validate')  # tune_batch.py's update; validate.py's forward


@dataclass(frozen=True)
class Headroom:
    """A default headroom and where it came from.

    Attributes:
        fraction: The share of the budget left free.
        origin: One line for the plan: what it was measured on, and by what.
    """
    fraction: float
    origin: str


@lru_cache(maxsize=None)
def _measured() -> dict:
    with open(HEADROOM_FILE) as f:
        return json.load(f)


def estimate_headroom(step: str) -> Headroom:
    """The headroom of a CUDA estimate's plan for `step` ('train' or 'validate'), as `headroom.json` records it."""
    entry = _measured()[step]
    rows = ', '.join(f"{table['rows']} of {table['name']}" for table in entry['tables'])
    origin = (f"the model's over-prediction that {entry['quantile']:.0%} of the decayed rows of timm's GPU tables "
              f"stay under ({rows}; each replayed with its own software), measured by {entry['measured_by']}")
    return Headroom(entry['fraction'], origin)
