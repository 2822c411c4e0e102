"""Training: train.py's parser, the one build of its stack, the loop, checkpoints, OOM recovery, the noise scale.

Nothing here imports `timm_ext.probe` or `timm_ext.tune`: they build on training, never the other way.
"""
from .args import build_parser, parse_args
from .loop import LoopConfig, TrainLoop
from .stack import TrainingStack, build_training_stack

__all__ = ['LoopConfig', 'TrainLoop', 'TrainingStack', 'build_parser', 'build_training_stack', 'parse_args']
