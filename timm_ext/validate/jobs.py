"""Which (model, checkpoint) pairs a validate.py command line asks for: one, or a bulk list as stock.

Stock rules, in order: a `--checkpoint` folder validates each checkpoint in it with `--model`; `--model all`
validates every model with pretrained ImageNet-1k weights; a name timm does not know is a wildcard over
pretrained models; failing that, an existing file is read as a list of names (one per line). A bulk job with
checkpoint None uses pretrained weights. Anything else is a single job, and an unknown name is an error here,
before anything is built.
"""
import glob
import os
from dataclasses import dataclass
from typing import List, Optional

from timm.models import is_model, list_models
from timm.utils import natural_key

from ..errors import TimmExtError

__all__ = ['ValidationJobs', 'CHECKPOINT_PATTERNS', 'NON_IN1K_FILTERS', 'resolve_jobs']

# weight files a checkpoint folder is searched for: stock's two, plus our safetensors exports
CHECKPOINT_PATTERNS = ('*.pth.tar', '*.pth', '*.safetensors')
# pretrained tags whose classifiers are not ImageNet-1k, left out of `--model all` as stock does
NON_IN1K_FILTERS = ['*_in21k', '*_in22k', '*in12k', '*_dino', '*fcmae', '*seer']


@dataclass
class ValidationJobs:
    """The models to validate: `bulk` is True for the stock bulk modes (probe always on, errors per model)."""
    jobs: List[tuple]  # (model name, checkpoint path or None for pretrained weights)
    bulk: bool
    description: str = ''


class JobsError(TimmExtError, ValueError):
    """The model or checkpoint arguments name nothing that can be validated (one-line message)."""


def resolve_jobs(model: str, checkpoint: Optional[str]) -> ValidationJobs:
    """Expand `--model` / `--checkpoint` into validation jobs.

    Raises:
        JobsError: an empty checkpoint folder, an empty names file, or a name that is no model, wildcard or file.
    """
    if checkpoint and os.path.isdir(checkpoint):
        files = {f for pattern in CHECKPOINT_PATTERNS for f in glob.glob(os.path.join(checkpoint, pattern))}
        if not files:
            raise JobsError(f'no checkpoints ({", ".join(CHECKPOINT_PATTERNS)}) in folder {checkpoint}')
        _check_model(model)
        return ValidationJobs([(model, f) for f in sorted(files, key=natural_key)], True,
                              f'{len(files)} checkpoints in {checkpoint} with model {model}')
    if model == 'all':
        names = list_models(pretrained=True, exclude_filters=NON_IN1K_FILTERS)
        return ValidationJobs([(n, None) for n in names], True, f'all {len(names)} pretrained models')
    if is_model(model):
        return ValidationJobs([(model, checkpoint or None)], False)
    names = list_models(model, pretrained=True)
    if names:
        return ValidationJobs([(n, None) for n in names], True, f'{len(names)} pretrained models matching {model}')
    if os.path.isfile(model):
        with open(model) as f:
            names = [line.strip() for line in f if line.strip()]
        if not names:
            raise JobsError(f'model list file {model} names no models')
        return ValidationJobs([(n, None) for n in names], True, f'{len(names)} models listed in {model}')
    raise JobsError(_unknown_model_message(model))


def _check_model(model: str) -> None:
    if not is_model(model):
        raise JobsError(_unknown_model_message(model))


def _unknown_model_message(model: str) -> str:
    close = list_models(f'*{model.split(".")[0][:6]}*')[:3] if model and '*' not in model else []
    hint = f' (similar: {", ".join(close)})' if close else ''
    return (f'unknown model {model!r}: not a timm model, a wildcard matching pretrained models, or a file of '
            f'names{hint}; see timm.list_models()')
