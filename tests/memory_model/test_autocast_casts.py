"""CUDA autocast's float32 ops against torch 2.14.1's lists (the installed aten/src/ATen/autocast_mode.h) and the
installed dispatcher's AutocastCPU registrations."""
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from timm_ext.memory_model.autocast_casts import (CUDA_FLOAT32_FUNCTIONS, CUDA_FLOAT32_OUTPUT_FUNCTIONS,
                                                  CudaAutocastCasts)

HEADER = Path(torch.__file__).parent / 'include' / 'ATen' / 'autocast_mode.h'
# the fp32 ops timm reaches through another entry point, so their own Python names need no entry
REACHED_OTHERWISE = {
    'native_layer_norm': 'F.layer_norm', 'frobenius_norm.dim': 'torch.norm (linalg_vector_norm)',
    'nuclear_norm': 'torch.norm(p="nuc") (linalg_matrix_norm)', 'nuclear_norm.dim': 'torch.norm(p="nuc")',
}
UPSAMPLING = re.compile(r'_?upsample_')  # F.interpolate's kernels: CudaAutocastCasts casts interpolate itself


def _listed(name: str) -> list:
    """The op overloads of one of the header's `AT_FORALL_*(_)` lists, as 'op' or 'op.overload'."""
    body = re.search(rf'#define {name}\(_\)(.*?)\n\n', HEADER.read_text(), re.S).group(1)
    return [op + (f'.{overload}' if overload else '') for op, overload in re.findall(r'_\((\w+)(?:,\s*(\w+))?\)', body)]


def _cpu_casts_too(op: str) -> bool:
    table = torch._C._dispatch_dump_table(f'aten::{op}')
    return any(line.startswith('AutocastCPU') and 'fallthrough' not in line for line in table.splitlines())


def _python_entries(op: str) -> set:
    name = op.split('.')[0]
    return {f for f in (getattr(torch, name, None), getattr(torch.Tensor, name, None), getattr(F, name, None)) if f}


@pytest.mark.parametrize('listing, covered', [('AT_FORALL_FP32', CUDA_FLOAT32_FUNCTIONS),
                                              ('AT_FORALL_FP32_SET_OPT_DTYPE', CUDA_FLOAT32_OUTPUT_FUNCTIONS)])
def test_every_cuda_float32_op_cpu_autocast_leaves_alone_is_cast(listing, covered):
    """aten/src/ATen/autocast_mode.cpp registers AT_FORALL_FP32 (fp32) and AT_FORALL_FP32_SET_OPT_DTYPE
    (fp32_set_opt_dtype) for AutocastCUDA (autocast_mode.h lists them); an op AutocastCPU falls through is one the
    CPU trace would keep in half precision."""
    missing = []
    for op in _listed(listing):
        if _cpu_casts_too(op) or op in REACHED_OTHERWISE or UPSAMPLING.match(op):
            continue
        entries = _python_entries(op)
        if op.startswith('linalg_'):
            entries = {getattr(torch.linalg, op.removeprefix('linalg_').split('.')[0])}
        if not entries & covered:
            missing.append(op)
    assert not missing


def test_float32_ops_run_on_float32_copies_and_the_set_opt_dtype_ones_only_return_float32():
    """autocast_mode.cpp: the fp32 policy casts its inputs (cached_cast); fp32_set_opt_dtype passes dtype=float32
    where the call named none (set_opt_dtype), so the op reads the half input; `interpolate`'s upsampling kernels are
    fp32 (upsample_*), its 'area' mode is a pooling that is not."""
    x = torch.randn(2, 8, 4, 4, dtype=torch.float16)
    with torch.autocast('cpu', dtype=torch.float16), CudaAutocastCasts():
        assert F.rms_norm(x, (4,)).dtype == torch.float32
        assert F.interpolate(x, scale_factor=2, mode='bilinear').dtype == torch.float32
        assert F.interpolate(x, scale_factor=2, mode='area').dtype == torch.float16
        assert (2 ** x).dtype == torch.float32 and x.exp().dtype == torch.float32
        assert x.sum().dtype == torch.float32 and x.softmax(-1).dtype == torch.float32
        assert x.sum(dtype=torch.float16).dtype == torch.float16  # a named dtype stays
    with torch.autocast('cpu', dtype=torch.float16):
        assert F.rms_norm(x, (4,)).dtype == torch.float16  # CPU autocast alone leaves it in half precision
