"""CUDA's kernels in the event log: each rule against the source it was read from (torch 2.14), and what the replay
would miss without it."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from timm_ext.memory_model.events import EventLog
from timm_ext.memory_model.kernels import cublas_workspace_bytes, cublaslt_workspace_bytes, cuda_allocations

MiB = 1 << 20


def _logged(run, module: nn.Module = None):
    """The 'o' events of `run` traced on fake tensors, as (signature, where, numbers), and their CUDA allocations."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        module = module or nn.Identity()
        log = EventLog(module.parameters(), [], dict(module.named_modules()))
        with log:
            run(module)
        log.remove_hooks()
    ops = [(log.names[e[1]], log.names[e[2]], e[3:]) for e in log.events if e[0] == 'o']
    return ops, [list(cuda_allocations(sig, numbers, where.startswith('backward'))) for sig, where, numbers in ops]


def test_cublas_keeps_one_workspace_per_handle_and_the_backward_runs_on_its_own_thread():
    """aten/src/ATen/cuda/CublasHandlePool.cpp, setWorkspaceForHandle: the workspace is allocated through the
    caching allocator per (handle, stream), and a handle is per thread (getCurrentCUDABlasHandle's PoolWindow)."""
    def train(fc):
        fc(torch.randn(8, 64, requires_grad=True)).sum().backward()
    ops, allocations = _logged(train, nn.Linear(64, 64))
    kept = {key for per_op in allocations for _, life, key in per_op if life == 'kept'}
    assert kept == {'cublas forward', 'cublas backward'}


def test_cublas_takes_32_mib_on_compute_capability_9_to_12_and_8_mib_below():
    """aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize: ":4096:8" where the major is 9, 10, 11 or 12
    (the installed libtorch_cuda.so: `major - 9 < 4`), else ":4096:2:16:8"; an unknown card is the newest's."""
    for major in (9, 10, 11, 12):
        assert cublas_workspace_bytes((major, 0), {}) == 32 * MiB
    for cc in ((7, 5), (8, 0), (8, 6), (8, 9)):
        assert cublas_workspace_bytes(cc, {}) == 8 * MiB + 128 * 1024
    assert cublas_workspace_bytes(None, {}) == 32 * MiB


def test_cublas_workspace_config_sums_every_size_times_its_count_and_falls_back_when_it_does_not_parse():
    """aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize: std::regex ":([0-9]+):([0-9]+)" searched
    through CUBLAS_WORKSPACE_CONFIG, total += SIZE * 1024 * COUNT; no match: the default (with a warning)."""
    assert cublas_workspace_bytes((8, 6), {'CUBLAS_WORKSPACE_CONFIG': ':4096:8'}) == 32 * MiB
    assert cublas_workspace_bytes((9, 0), {'CUBLAS_WORKSPACE_CONFIG': ':16:8'}) == 128 * 1024
    assert cublas_workspace_bytes((9, 0), {'CUBLAS_WORKSPACE_CONFIG': 'x:4096:2:16:8'}) == 8 * MiB + 128 * 1024
    assert cublas_workspace_bytes((8, 0), {'CUBLAS_WORKSPACE_CONFIG': '4096'}) == 8 * MiB + 128 * 1024
    kept = list(cuda_allocations('matmul', [], False, (9, 0), {'CUBLAS_WORKSPACE_CONFIG': ':0:0'}))
    assert kept == [(0, 'kept', 'cublas forward')]


def test_cublaslt_shares_the_cublas_workspace_unless_told_not_to():
    """aten/src/ATen/cuda/CublasHandlePool.cpp, unified_cublas_and_lt_workspaces: unified unless
    TORCH_CUBLASLT_UNIFIED_WORKSPACE is "0" (c10::utils::check_env); then getCUDABlasLtWorkspace keeps its own
    CUBLASLT_WORKSPACE_SIZE KiB (parseCUDABlasLtWorkspaceSize: 1024 by default, std::stoi's reading)."""
    def keys(environ):
        return [(n, key) for n, _, key in cuda_allocations('matmul lt', [], True, (8, 0), environ)]
    assert keys({}) == keys({'TORCH_CUBLASLT_UNIFIED_WORKSPACE': '1'}) == [(8 * MiB + 128 * 1024, 'cublas backward')]
    assert keys({'TORCH_CUBLASLT_UNIFIED_WORKSPACE': '0'})[1] == (MiB, 'cublaslt backward')
    separate = {'TORCH_CUBLASLT_UNIFIED_WORKSPACE': '0', 'CUBLASLT_WORKSPACE_SIZE': '4096kb'}
    assert cublaslt_workspace_bytes(separate) == 4 * MiB
    ops, _ = _logged(lambda fc: fc(torch.randn(8, 64)), nn.Linear(64, 64))
    assert [sig for sig, _, _ in ops] == ['matmul lt']  # a Linear with a bias: addmm, the Lt epilogue


def test_layer_norm_copies_a_permuted_input_in_the_forward_and_its_gradient_in_the_backward():
    # aten/src/ATen/native/cuda/layer_norm_kernel.cu: `input.expect_contiguous()` in both passes, `dY.contiguous()`
    # in the backward; timm's LayerNorm2d normalizes a permuted (channels-last view of a channels-first) tensor
    x = torch.randn(4, 32, 16, 16)
    nbytes = x.numel() * 4

    def channels_first(ln):
        y = torch.randn(4, 32, 16, 16, requires_grad=True)
        ln(y.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).pow(2).sum().backward()
    ops, allocations = _logged(channels_first, nn.LayerNorm(32))
    forward, backward = [a for (sig, _, _), a in zip(ops, allocations) if 'layer_norm' in sig]
    assert [n for n, life, _ in forward] == [nbytes] and forward[0][1] == 'op'
    assert sum(n for n, _, _ in backward) == nbytes  # the permuted input again (its gradient comes contiguous)

    def contiguous(ln):
        ln(torch.randn(4, 16, 16, 32, requires_grad=True)).pow(2).sum().backward()  # a contiguous gradient
    ops, allocations = _logged(contiguous, nn.LayerNorm(32))
    assert not any(allocations[i] for i, (sig, _, _) in enumerate(ops) if 'layer_norm' in sig)

    def expanded_gradient(ln):  # sum()'s gradient is an expanded scalar: the backward copies it
        ln(torch.randn(4, 16, 16, 32, requires_grad=True)).sum().backward()
    ops, allocations = _logged(expanded_gradient, nn.LayerNorm(32))
    assert [sum(n for n, _, _ in a) for (sig, _, _), a in zip(ops, allocations) if 'layer_norm' in sig] == [0, nbytes]


def test_a_cudnn_convolution_asks_for_an_adaptive_workspace_keyed_by_its_shape():
    # aten/src/ATen/native/cudnn/Conv_v8.cpp: with benchmark, only plans whose workspace fits are kept, the largest
    # halved on OOM: a workspace shrinks to what is free and never fails the step by itself
    def conv(c):
        c(torch.randn(2, 8, 16, 16, requires_grad=True)).sum().backward()
    ops, allocations = _logged(conv, nn.Conv2d(8, 8, 3))
    lives = [life for per_op in allocations for _, life, _ in per_op]
    assert lives == ['adaptive', 'adaptive']  # the forward and the backward
    assert ops[0][0] != ops[1][0] and '(8, 16, 16)' in ops[0][0]  # one search per shape, the batch left out
