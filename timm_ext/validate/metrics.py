"""Precision, recall and F1 of single-label predictions, without scikit-learn.

Stock validate.py computes these with scikit-learn and silently drops them when it is not installed. The same
numbers come from a confusion count in a few tensor operations: labels are those seen in the targets or the
predictions, a class with an empty denominator scores 0 (scikit-learn's `zero_division=0`), 'macro' averages the
classes equally, 'weighted' by their support, 'micro' pools all decisions (which for single-label
classification equals accuracy).
"""
from typing import Dict

import torch

__all__ = ['AVERAGES', 'precision_recall_f1']

AVERAGES = ('micro', 'macro', 'weighted')


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / den.clamp(min=1), torch.zeros_like(num))


def precision_recall_f1(preds: torch.Tensor, targets: torch.Tensor, average: str) -> Dict[str, float]:
    """Return precision, recall and F1 (fractions in [0, 1]) of class predictions against targets.

    Args:
        preds: Predicted class indices, shape (N,).
        targets: True class indices, shape (N,).
        average: 'micro', 'macro' or 'weighted', as scikit-learn's `average=`.

    Returns:
        {'precision': p, 'recall': r, 'f1': f}.
    """
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {', '.join(AVERAGES)}, got {average!r}")
    preds, targets = preds.long().flatten(), targets.long().flatten()
    if preds.numel() == 0:
        return {'precision': 0.0, 'recall': 0.0, 'f1': 0.0}
    labels = torch.unique(torch.cat([preds, targets]))
    size = int(labels.max()) + 1
    tp = torch.bincount(targets[preds == targets], minlength=size)[labels].double()
    predicted = torch.bincount(preds, minlength=size)[labels].double()
    support = torch.bincount(targets, minlength=size)[labels].double()

    if average == 'micro':
        p = r = _safe_div(tp.sum(), predicted.sum())
        f = _safe_div(2 * tp.sum(), predicted.sum() + support.sum())
        return {'precision': float(p), 'recall': float(r), 'f1': float(f)}

    precision = _safe_div(tp, predicted)
    recall = _safe_div(tp, support)
    f1 = _safe_div(2 * tp, predicted + support)
    weights = torch.ones_like(support) / len(labels) if average == 'macro' else _safe_div(support, support.sum())
    return {name: float((v * weights).sum()) for name, v in (('precision', precision), ('recall', recall), ('f1', f1))}
