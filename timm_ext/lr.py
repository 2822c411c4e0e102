"""Learning rate from the global batch size: timm's `--lr-base*` rule, in one function every script shares.

When `--lr` is not given, timm scales `--lr-base` (set for `--lr-base-size` samples) to the run's global batch,
`batch_size * world_size * grad_accum_steps`: linearly, or by the square root for adaptive optimizers. The scale
is decided from the optimizer name (`ada` or `lamb` in it means sqrt) when `--lr-base-scale` is empty. We keep
that rule exactly, so a run's LR is the one stock timm would pick, and add a hint when the name rule looks wrong.
"""
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ['LrChoice', 'LR_SCALES', 'default_lr_scale', 'adaptive_hint', 'resolve_lr', 'rescale_lr', 'scale_group_lrs']

LR_SCALES = ('linear', 'sqrt')

# Optimizer names that mean sqrt scaling in timm's rule.
_SQRT_NAME_MARKERS = ('ada', 'lamb')
# Adaptive (per-parameter normalised or sign-based) optimizers whose names the stock rule reads as linear.
_ADAPTIVE_NAME_MARKERS = ('adopt', 'ademamix', 'laprop', 'lion', 'muon', 'kron', 'mars', 'madgrad', 'novograd',
                          'rmsprop')


@dataclass(frozen=True)
class LrChoice:
    """The learning rate a run uses and how it was reached.

    Attributes:
        lr: The learning rate.
        global_batch: Samples per optimizer update (batch_size * world_size * grad_accum_steps).
        scale: 'linear' or 'sqrt' when the LR was scaled from `lr_base`; '' when `--lr` was given.
        from_base: True when the LR was computed from `lr_base`, False when `--lr` was given.
        message: One log line stating the LR, its base, the global batch and the rule.
        hint: A log line when the optimizer looks adaptive but the name rule chose linear, else None.
    """
    lr: float
    global_batch: float
    scale: str
    from_base: bool
    message: str
    hint: Optional[str] = None


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f'{name} must be a number > 0, got {value!r}')


def _check_scale(lr_base_scale: str) -> None:
    if lr_base_scale not in ('',) + LR_SCALES:
        raise ValueError(f"lr_base_scale must be one of '', 'linear', 'sqrt' (empty: chosen from the optimizer), "
                         f"got {lr_base_scale!r}")


def default_lr_scale(opt: str) -> str:
    """The stock rule: 'sqrt' when the optimizer name contains 'ada' or 'lamb', else 'linear'."""
    name = opt.lower()
    return 'sqrt' if any(marker in name for marker in _SQRT_NAME_MARKERS) else 'linear'


def adaptive_hint(opt: str, scale: str) -> Optional[str]:
    """A hint when `opt` is an adaptive optimizer that got linear scaling only because of its name."""
    name = opt.lower()
    if scale == 'linear' and any(marker in name for marker in _ADAPTIVE_NAME_MARKERS):
        return (f"Hint: optimizer '{opt}' is adaptive, but timm's name rule (sqrt only for names containing 'ada' "
                f"or 'lamb') chose linear LR scaling; pass --lr-base-scale sqrt if that is what you want.")
    return None


def resolve_lr(
        lr: Optional[float],
        lr_base: float,
        lr_base_size: int,
        lr_base_scale: str,
        opt: str,
        batch_size: float,
        world_size: int = 1,
        grad_accum_steps: int = 1,
) -> LrChoice:
    """Choose the learning rate of a run as stock timm train.py does.

    Args:
        lr: `--lr`; when set (non-zero) it is used as is.
        lr_base: `--lr-base`, the LR for `lr_base_size` samples per update.
        lr_base_size: `--lr-base-size`.
        lr_base_scale: `--lr-base-scale`: 'linear', 'sqrt', or '' to choose from the optimizer name.
        opt: `--opt`, the optimizer name.
        batch_size: Per-process micro-batch (a float where a resolution schedule averages several).
        world_size: Number of processes.
        grad_accum_steps: Micro-batches per optimizer update.

    Returns:
        The chosen LR with its global batch, rule and log lines.

    Raises:
        ValueError: A size is not positive or the scale name is unknown.
    """
    _check_positive('batch_size', batch_size)
    _check_positive('world_size', world_size)
    _check_positive('grad_accum_steps', grad_accum_steps)
    _check_positive('lr_base_size', lr_base_size)
    _check_scale(lr_base_scale)
    global_batch = batch_size * world_size * grad_accum_steps
    if lr:
        return LrChoice(
            lr=lr, global_batch=global_batch, scale='', from_base=False,
            message=f'Learning rate {lr} given by --lr (global batch {global_batch:g}; no base scaling).')
    scale = lr_base_scale or default_lr_scale(opt)
    ratio = global_batch / lr_base_size
    new_lr = lr_base * (ratio ** 0.5 if scale == 'sqrt' else ratio)
    how = 'set' if lr_base_scale else f"chosen from optimizer '{opt}'"
    message = (f'Learning rate {new_lr:g} = lr_base {lr_base:g} scaled by {scale} rule ({how}) for global batch '
               f'{global_batch:g} (= {batch_size:g} x {world_size} ranks x {grad_accum_steps} accum) '
               f'vs lr_base_size {lr_base_size}.')
    return LrChoice(new_lr, global_batch, scale, True, message, adaptive_hint(opt, scale))


def rescale_lr(lr: float, old_global: float, new_global: float, scale: str) -> float:
    """Move an LR tuned for `old_global` samples per update to `new_global` by the 'linear' or 'sqrt' rule."""
    _check_positive('old_global', old_global)
    _check_positive('new_global', new_global)
    if scale not in LR_SCALES:
        raise ValueError(f"scale must be one of 'linear', 'sqrt', got {scale!r}")
    ratio = new_global / old_global
    return lr * (ratio ** 0.5 if scale == 'sqrt' else ratio)


def scale_group_lrs(optimizer: Any, factor: float) -> None:
    """Multiply every param group's LR and its scheduler base (``initial_lr``) by `factor` (an optimizer's groups)."""
    if factor == 1.0:
        return
    for group in optimizer.param_groups:
        for key in ('lr', 'initial_lr'):
            if key in group:
                group[key] *= factor
