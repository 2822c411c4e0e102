"""Load model weights for evaluation from stock timm or our checkpoints, or safetensors exports.

Reads `.pth.tar` / `.pth` training checkpoints (stock keys: state_dict, state_dict_ema, args, arch; our
train.py writes the same keys plus resume state, all weights-only loadable), plain state dicts, and `.safetensors`
weight files. Every failure is a `WeightsError` with a one-line message naming the file and the fix: a missing or
unreadable file, a file without weights, or weights of another architecture or class count.
"""
import argparse
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
from timm.models import clean_state_dict

from ..errors import TimmExtError

__all__ = ['WeightsError', 'CheckpointWeights', 'one_line', 'read_weights', 'load_weights', 'checkpoint_num_classes']

_logger = logging.getLogger(__name__)


class WeightsError(TimmExtError):
    """Weights that cannot be used; the message is one line meant for the user."""


@dataclass
class CheckpointWeights:
    """A state dict read from a file, with what the file says about where it came from.

    Attributes:
        state_dict: Weights with DDP/compile prefixes removed.
        source: Which entry was used: 'state_dict', 'state_dict_ema', 'model_ema', 'model', 'weights'.
        arch: The architecture the checkpoint names (its `arch` key), if any.
        num_classes: The class count of the run that wrote it (its `args.num_classes`), if recorded.
    """
    state_dict: Dict[str, torch.Tensor] = field(repr=False)
    source: str
    arch: Optional[str] = None
    num_classes: Optional[int] = None


def one_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (its type name when empty), cut to `limit` characters."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:limit]


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(torch.is_tensor(v) for v in obj.values())


def _load_file(path: str) -> Any:
    if path.endswith('.safetensors'):
        from safetensors.torch import load_file
        return load_file(path, device='cpu')
    # weights_only keeps a checkpoint from running code; stock checkpoints pickle their args as a Namespace
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location='cpu', weights_only=True)


def read_weights(path: str, use_ema: bool = False) -> CheckpointWeights:
    """Read the weights to evaluate from `path`.

    Args:
        path: A `.pth.tar`, `.pth` or `.safetensors` file.
        use_ema: Take the EMA weights (`state_dict_ema`, or `model_ema`) when the file holds them; otherwise the
            regular weights are used and a warning says so, as the stock loader silently does.

    Raises:
        WeightsError: Missing or unreadable file, or no weights in it.
    """
    if not os.path.isfile(path):
        raise WeightsError(f'checkpoint not found: {path}; pass --checkpoint with an existing weights file')
    try:
        content = _load_file(path)
    except Exception as e:  # truncated zips, pickles, headers: each library raises its own types
        raise WeightsError(f'cannot read checkpoint {path} ({type(e).__name__}: {one_line(e)}); '
                           f'it is not a complete .pth.tar/.pth/.safetensors weights file') from None

    if _is_state_dict(content):
        if use_ema:
            _logger.warning(f'{path} holds one set of weights (no EMA entry); --use-ema has nothing to select.')
        return CheckpointWeights(clean_state_dict(content), 'weights')
    if not isinstance(content, dict):
        raise WeightsError(f'checkpoint {path} holds a {type(content).__name__}, not model weights')

    keys = (('state_dict_ema', 'model_ema') if use_ema else ()) + ('state_dict', 'model')
    source = next((k for k in keys if _is_state_dict(content.get(k))), None)
    if source is None:
        raise WeightsError(f'checkpoint {path} holds no model weights (none of: {", ".join(keys)})')
    if use_ema and source not in ('state_dict_ema', 'model_ema'):
        _logger.warning(f'{path} has no EMA weights; --use-ema falls back to its {source}.')

    run_args = content.get('args')
    num_classes = run_args.get('num_classes') if isinstance(run_args, dict) else getattr(run_args, 'num_classes', None)
    arch = content.get('arch')
    return CheckpointWeights(clean_state_dict(content[source]), source,
                             arch if isinstance(arch, str) else None,
                             num_classes if isinstance(num_classes, int) else None)


def checkpoint_num_classes(weights: CheckpointWeights, model_name: str) -> Optional[int]:
    """The class count the weights were trained with: recorded in the checkpoint's args, else the row count of the
    model's classifier weight in the state dict (safetensors exports record nothing else). None when unknown."""
    if weights.num_classes is not None:
        return weights.num_classes
    from timm.models import get_pretrained_cfg_value
    head = get_pretrained_cfg_value(model_name, 'classifier')
    head = head[0] if isinstance(head, (list, tuple)) and head else head
    tensor = weights.state_dict.get(f'{head}.weight') if isinstance(head, str) else None
    return int(tensor.shape[0]) if tensor is not None and tensor.dim() >= 1 else None


def _mismatch_summary(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor]) -> str:
    own = model.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    reshaped = [k for k in own if k in state_dict and own[k].shape != state_dict[k].shape]
    parts = [f'{len(v)} {name} (e.g. {v[0]})' for name, v in
             (('missing', missing), ('unexpected', unexpected), ('shape-mismatched', reshaped)) if v]
    return ', '.join(parts) or 'incompatible keys'


def _classifier_outputs(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor]) -> Optional[int]:
    """The class count of the checkpoint when only the classifier differs from the model, else None."""
    own = model.state_dict()
    if set(own) != set(state_dict):
        return None
    differing = [k for k in own if own[k].shape != state_dict[k].shape]
    head = getattr(model, 'pretrained_cfg', {}).get('classifier') or ''
    heads = (head,) if isinstance(head, str) else tuple(head)
    if differing and heads and all(k.startswith(heads) for k in differing):
        return int(state_dict[differing[0]].shape[0])
    return None


def load_weights(model: torch.nn.Module, weights: CheckpointWeights, path: str, model_name: str) -> None:
    """Load `weights` into `model` strictly, turning a mismatch into a one-line `WeightsError` with the fix."""
    try:
        model.load_state_dict(weights.state_dict, strict=True)
    except RuntimeError:
        classes = _classifier_outputs(model, weights.state_dict)
        if classes is not None:
            hint = f'its classifier has {classes} outputs: pass --num-classes {classes}'
        elif weights.arch and weights.arch != model_name:
            hint = f'it was saved from {weights.arch!r}: pass --model {weights.arch}'
        else:
            hint = 'pass the --model (and --num-classes, --model-kwargs) it was trained with'
        raise WeightsError(f'checkpoint {path} does not fit model {model_name!r}: '
                           f'{_mismatch_summary(model, weights.state_dict)}; {hint}') from None
    _logger.info(f"Loaded {weights.source} from checkpoint '{path}'")
