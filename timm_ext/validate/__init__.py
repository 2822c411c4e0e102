"""Evaluation: validate.py's parser, the eval pass that retries smaller batches, weights, bulk jobs, results files."""
from .args import parse_validate_args
from .evaluate import validate_model

__all__ = ['parse_validate_args', 'validate_model']
