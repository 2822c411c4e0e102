"""Mixed-precision resolution shared by train.py and validate.py.

`resolve_amp` turns the `--amp` / `--amp-dtype` flags and a device into one decision: the autocast context to
enter around forward passes, whether a gradient scaler is needed, and one line for the log. Where the device's
autocast cannot run the asked dtype (float16 on a CPU without half kernels), it falls back to bfloat16 and says
so, instead of torch's silent "disabling autocast" warning.
"""
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable, ContextManager, Optional

import torch

__all__ = ['AmpChoice', 'AMP_DTYPES', 'MODEL_DTYPES', 'parse_amp_dtype', 'resolve_amp']

AMP_DTYPES = {'float16': torch.float16, 'bfloat16': torch.bfloat16}
# --model-dtype: the dtype of weights and inputs when not training in AMP
MODEL_DTYPES = {'float32': torch.float32, 'float16': torch.float16, 'bfloat16': torch.bfloat16}


@dataclass(frozen=True)
class AmpChoice:
    """The precision a run will use.

    Attributes:
        autocast: Zero-argument factory of the context manager to wrap forward passes in
            (`torch.autocast` when AMP is on, `nullcontext` when off); the stock scripts' `amp_autocast`.
        dtype: The autocast dtype, or None when AMP is off.
        use_grad_scaler: Whether training needs a loss scaler (float16 on CUDA only, as stock).
        message: One log line saying what was chosen and, on a fallback, why.
    """
    autocast: Callable[[], ContextManager]
    dtype: Optional[torch.dtype]
    use_grad_scaler: bool
    message: str

    @property
    def enabled(self) -> bool:
        return self.dtype is not None


def parse_amp_dtype(name: str) -> torch.dtype:
    """Map an `--amp-dtype` value to a torch dtype, raising a one-line ValueError for anything else."""
    if name not in AMP_DTYPES:
        raise ValueError(f"--amp-dtype {name!r} is not supported; use one of: {', '.join(AMP_DTYPES)}")
    return AMP_DTYPES[name]


def _autocast_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """True when autocast on `device` really computes a matmul in `dtype`.

    torch answers an unsupported autocast dtype with a warning and a disabled context, and some builds accept
    the dtype but lack kernels for it; a 2x2 matmul on the device tells both apart cheaply. The matmul runs on
    `device` itself (cuda:1 is not cuda): a bare 'cuda' would open a context on another GPU.
    """
    if not torch.amp.is_autocast_available(device.type):
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            with torch.autocast(device_type=device.type, dtype=dtype):
                a = torch.ones(2, 2, device=device)
                return (a @ a).dtype == dtype
    except (RuntimeError, NotImplementedError):
        return False


def resolve_amp(device: torch.device, amp: bool, amp_dtype: str = 'float16') -> AmpChoice:
    """Decide the autocast context, loss scaling and log line for a run.

    Args:
        device: The device the model runs on.
        amp: Whether mixed precision was asked for (`--amp`).
        amp_dtype: The asked autocast dtype name (`--amp-dtype`): 'float16' or 'bfloat16'.

    Returns:
        The resolved choice. float16 that cannot run on the device falls back to bfloat16 (and the reverse on
        CUDA devices without bfloat16); when neither runs, AMP is off. The message says which.

    Raises:
        ValueError: `amp_dtype` is not a supported name (checked even when AMP is off, as a typo is a typo).
    """
    asked = parse_amp_dtype(amp_dtype)
    if not amp:
        return AmpChoice(nullcontext, None, False, 'AMP not enabled; running in the model dtype.')

    device = torch.device(device)
    device_type = device.type
    other = torch.bfloat16 if asked == torch.float16 else torch.float16
    for dtype in (asked, other):
        if _autocast_runs(device, dtype):
            break
    else:
        return AmpChoice(
            nullcontext, None, False,
            f'AMP asked but autocast cannot run float16 or bfloat16 on {device_type}; running without AMP.')

    autocast = partial(torch.autocast, device_type=device_type, dtype=dtype)
    use_grad_scaler = device_type == 'cuda' and dtype == torch.float16
    name = str(dtype).replace('torch.', '')
    if dtype == asked:
        message = f'Using native torch AMP: autocast to {name} on {device_type}.'
    else:
        message = (f'Using native torch AMP: {amp_dtype} autocast is not supported on {device_type}, '
                   f'falling back to {name}.')
    return AmpChoice(autocast, dtype, use_grad_scaler, message)
