"""The CUDA backend flags of a run: TF32 matmuls and cuDNN autotuning, set once, the same for every entry point.

Stock timm's train.py and validate.py turn on `torch.backends.cuda.matmul.allow_tf32` and `cudnn.benchmark` when
CUDA is there. A probe that times its trials without them times another regime (full fp32 matmuls, other cuDNN
algorithms with other workspaces), so train.py, validate.py, tune_batch.py and the critical-batch warm-up all call
`configure_cuda_backends` before their first CUDA work. `CUDA_GRAPH_MODES` names the torch.compile modes that record
CUDA graphs, whose tree's memory pool `empty_cache` does not release.
"""
from typing import Union

import torch

__all__ = ['configure_cuda_backends', 'CUDA_GRAPH_MODES']

# torch.compile modes that record CUDA graphs, and the same compilation without them
CUDA_GRAPH_MODES = {'reduce-overhead': None, 'max-autotune': 'max-autotune-no-cudagraphs'}


def configure_cuda_backends(device: Union[str, torch.device]) -> bool:
    """Turn on TF32 matmuls and cuDNN autotuning for a run on `device`, as stock timm does on CUDA.

    Stock sets them whenever CUDA is available; here the device decides, which differs only for a CPU run on a GPU
    machine, where neither flag has any effect.

    Returns:
        True when the flags were set (a CUDA device), False otherwise.
    """
    if torch.device(device).type != 'cuda':
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    return True
