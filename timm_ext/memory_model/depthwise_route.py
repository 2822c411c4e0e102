"""Which kernel runs a 2-d depthwise convolution on CUDA, as a function of the run's torch and cuDNN.

Read in the 1.12.1, 2.9.1 and 2.14.1 wheels (`timm_ext.memory_model.kernel_limits`), and between and around them
from the changes of `timm_ext.memory_model.release_history`: the 1.12.1 route (no 32-bit test) holds up to torch 2.8,
whose kernel raises a RuntimeError that timm's decay takes for an out-of-memory (pytorch#155225): the batch where the
input crosses is a batch that does not run; from 2.9 (pytorch#153101, #156140; the release assumed, see
`DEPTHWISE_64BIT_TO_CUDNN`) large ones go to cuDNN 9.3+ (pytorch#134890's 90300); from 2.9 (#163171) a
channels-last one is refused above cuDNN 9.10.0, and from 2.10 (#168364, assumed) only up to 9.14. The run's cuDNN
decides within its torch's rule: `--software torch=2.9.1,cudnn=9.2.1` sends large contiguous ones to PyTorch's
kernel, `cudnn=9.15.0` under torch 2.10+ runs channels-last ones on cuDNN.

`kernel_limits.launch_limit` turns the route into a batch limit.
"""
from .release_history import (
    CUDNN_64BIT_FROM, CUDNN_DEPTHWISE_BROKEN_ABOVE, CUDNN_DEPTHWISE_FIXED_FROM, DEPTHWISE_64BIT_TO_CUDNN,
    DEPTHWISE_CHANNELS_LAST_FROM_915, DEPTHWISE_CHANNELS_LAST_REFUSED, in_force,
)
from .versions import Software

__all__ = ['depthwise_route']


def _cudnn_refuses_channels_last(software: Software) -> bool:
    """use_cudnn_depthwise refuses a channels-last depthwise convolution past 32-bit indexing: from torch 2.9
    (pytorch#163171) for a cuDNN above 9.10.0, and from torch 2.10 (pytorch#168364) only up to 9.14; the cuDNN
    decides within the rule of the torch (`release_history`)."""
    if not in_force(DEPTHWISE_CHANNELS_LAST_REFUSED, software) or not in_force(CUDNN_DEPTHWISE_BROKEN_ABOVE, software):
        return False
    return not (in_force(DEPTHWISE_CHANNELS_LAST_FROM_915, software) and in_force(CUDNN_DEPTHWISE_FIXED_FROM, software))


def depthwise_route(software: Software, channels_last: bool, half: bool, cudnn_shape: bool, fits: bool) -> str:
    """Which kernel runs a 2-d depthwise convolution: 'cudnn' or 'native' (PyTorch's 32-bit kernel).

    Before torch 2.9 (`release_history.DEPTHWISE_64BIT_TO_CUDNN`) `use_cudnn_depthwise` has no 32-bit test: every
    channels-last one and every float16 one of cuDNN's shape goes to cuDNN (which splits the batch), every other to
    PyTorch's kernel, whatever its size. From 2.9 one past 32-bit indexing goes to cuDNN when the run's cuDNN is 9.3 or
    newer (`CUDNN_64BIT_FROM`), unless cuDNN refuses it channels-last (`_cudnn_refuses_channels_last`).

    Args:
        software: The run's torch and cuDNN.
        channels_last: `cudnn_conv_suggest_memory_format` is channels-last (input or weight).
        half: The input and weight are float16.
        cudnn_shape: The float16 rule's shape test passes (`KernelSizes` records it).
        fits: The input and weight fit 32-bit indexing.
    """
    small = 'cudnn' if channels_last or (half and cudnn_shape) else 'native'
    if fits or not in_force(DEPTHWISE_64BIT_TO_CUDNN, software):
        return small
    large = in_force(CUDNN_64BIT_FROM, software)
    return 'cudnn' if large and not (channels_last and _cudnn_refuses_channels_last(software)) else 'native'
