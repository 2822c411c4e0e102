"""Validation results files: csv or json, written atomically.

The stock script opens the results file for writing before it knows what to write and takes the csv header from
the first row, so an interrupted write leaves a truncated file and rows with other keys (a failed model's `error`,
the precision/recall fields) break the writer. Here the header is the union of every row's keys in first-seen
order, and the file is written under a temporary name, fsynced and renamed over the old one.
"""
import csv
import io
import json
from typing import Any, Dict, List, Sequence, Union

from ..atomic_files import atomic_text

__all__ = ['RESULT_FORMATS', 'results_text', 'write_results']

RESULT_FORMATS = ('csv', 'json')

Row = Dict[str, Any]


def _union_keys(rows: Sequence[Row]) -> List[str]:
    keys: Dict[str, None] = {}
    for row in rows:
        keys.update(dict.fromkeys(row))
    return list(keys)


def results_text(results: Union[Row, Sequence[Row]], fmt: str = 'csv') -> str:
    """Render results (one row or a list of rows) as the text of a csv or json results file."""
    if fmt == 'json':
        return json.dumps(results, indent=4) + '\n'
    if fmt != 'csv':
        raise ValueError(f"results format must be one of {', '.join(RESULT_FORMATS)}, got {fmt!r}")
    rows = [results] if isinstance(results, dict) else list(results)
    if not rows:
        return ''
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=_union_keys(rows), restval='', lineterminator='\n')
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def write_results(path: str, results: Union[Row, Sequence[Row]], fmt: str = 'csv') -> None:
    """Write results to `path` atomically: readers see the old file or the complete new one, never a part."""
    atomic_text(results_text(results, fmt), path)
