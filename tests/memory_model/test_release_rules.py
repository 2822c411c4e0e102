"""Rules that differ between the torch releases the model covers (versions.RELEASES): cuBLAS and cuBLASLt workspaces,
the allocator's options and CUDA autocast's float32 lists, each checked at every release where it differs."""
import pytest
import torch
import torch.nn.functional as F

from timm_ext.errors import UsageError
from timm_ext.memory_model.allocator_config import (AllocatorConfig, allocator_config, expandable_setting,
                                                    parse_allocator_conf)
from timm_ext.memory_model.allocator_releases import allocator_variables, known_options
from timm_ext.memory_model.autocast_casts import (CudaAutocastCasts, casts_upsampling, cuda_float32_functions,
                                                  cuda_float32_output_functions)
from timm_ext.memory_model.kernels import (cublas_workspace_bytes, cublaslt_unified, cublaslt_workspace_bytes,
                                           cuda_allocations)
from timm_ext.memory_model.versions import PINNED, RELEASES, Software

MiB = 1 << 20
SMALL_WORKSPACE = 8 * MiB + 128 * 1024  # ":4096:2:16:8"
T112, T291_CU128, T291, T214 = RELEASES


def test_cublas_default_workspace_per_release_and_compute_capability():
    """aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize: v2.14.1 gives 32 MiB to majors 9-12 (its
    libtorch_cuda.so: `major - 9 < 4`), v2.9.1 only to 9.0 (its libtorch_cuda.so compares major and minor with
    (9, 0)); v1.12.1 sets no workspace, cuBLAS 11 keeps its own ":4096:2:16:8" for every card."""
    for cc in ((9, 0), (10, 0), (12, 0)):
        assert cublas_workspace_bytes(cc, {}, T214) == 32 * MiB
    assert cublas_workspace_bytes((9, 0), {}, T291) == cublas_workspace_bytes((9, 0), {}, T291_CU128) == 32 * MiB
    for cc in ((10, 0), (12, 0), (8, 9)):  # RTX Pro 6000 and RTX 5090 are 12.0, RTX 4090 8.9
        assert cublas_workspace_bytes(cc, {}, T291) == SMALL_WORKSPACE
    for cc in ((8, 6), (9, 0)):
        assert cublas_workspace_bytes(cc, {}, T112) == SMALL_WORKSPACE
    assert cublas_workspace_bytes((12, 0), {}) == 32 * MiB  # the pinned release by default
    # CUBLAS_WORKSPACE_CONFIG is read the same way everywhere (v1.12.1: by cuBLAS itself; an assumption)
    for software in RELEASES:
        assert cublas_workspace_bytes((8, 6), {'CUBLAS_WORKSPACE_CONFIG': ':4096:8'}, software) == 32 * MiB


def test_cublas_workspace_is_replayed_as_a_kept_block_in_every_release():
    """aten/src/ATen/cuda/CublasHandlePool.cpp, getCurrentCUDABlasHandle: v2.9.1 and v2.14.1 call
    cublasSetWorkspace with a caching-allocator block (setWorkspaceForHandle); v1.12.1 sets none (the stored text of
    that era, and the 1.12.1 wheel's libtorch_cuda.so imports no cublasSetWorkspace), so cuBLAS cudaMallocs its own,
    which the replay keeps as an allocator block of the same bytes (an approximation: its segment rounding is not
    cuBLAS's)."""
    assert cublas_workspace_bytes((8, 6), {}, T112) == SMALL_WORKSPACE
    for software in (T112, T291, T214, Software((2, 6, 0), (12, 4), None)):  # 2.6.0: planned as the nearest, 2.9.1
        workspace = cublas_workspace_bytes((8, 6), {}, software)
        for backward, thread in ((False, 'forward'), (True, 'backward')):
            allocations = list(cuda_allocations('matmul', [], backward, (8, 6), {}, software))
            assert allocations == [(workspace, 'kept', f'cublas {thread}')], software.torch


def test_cublaslt_workspace_unified_by_default_only_in_2_14():
    """aten/src/ATen/cuda/CublasHandlePool.cpp: TORCH_CUBLASLT_UNIFIED_WORKSPACE through c10::utils::check_env
    ("1" true, "0" false); unset, v2.14.1's unified_cublas_and_lt_workspaces defaults to unified and v2.9.1's
    getCUDABlasLtWorkspaceSize to separate (both read in the wheels' libtorch_cuda.so), then
    getCUDABlasLtWorkspace keeps CUBLASLT_WORKSPACE_SIZE KiB (1024) per (handle, stream)."""
    assert cublaslt_unified({}, T214) and not cublaslt_unified({}, T291)
    assert cublaslt_unified({'TORCH_CUBLASLT_UNIFIED_WORKSPACE': '1'}, T291)
    assert not cublaslt_unified({'TORCH_CUBLASLT_UNIFIED_WORKSPACE': '0'}, T214)
    assert cublaslt_workspace_bytes({}, T214) == 0 and cublaslt_workspace_bytes({}, T291) == MiB
    assert cublaslt_workspace_bytes({'CUBLASLT_WORKSPACE_SIZE': '4096'}, T291) == 4 * MiB

    def keys(software, cc=(12, 0)):
        return [(n, life, key) for n, life, key in cuda_allocations('matmul lt', [], False, cc, {}, software)]
    assert keys(T214) == [(32 * MiB, 'kept', 'cublas forward')]
    # getCurrentCUDABlasLtHandle is the cuBLAS handle (2.9.1's libtorch_cuda.so: a jump to getCurrentCUDABlasHandle)
    assert keys(T291) == [(SMALL_WORKSPACE, 'kept', 'cublas forward'), (MiB, 'kept', 'cublaslt forward')]


def test_cublaslt_in_torch_1_12_is_a_per_call_workspace_from_cuda_11_4():
    """aten/src/ATen/native/cuda/Blas.cpp, addmm_out_cuda_impl: cuBLASLt's epilogue only with CUDA_VERSION >= 11040
    (read from stored copies after v1.12.1; the v1.12.1 text was not found: an assumption), and
    aten/src/ATen/cuda/CUDABlas.cpp, gemm_and_bias: a 1 MiB at::empty for the call (pytorch#73328). timm's RTX 3090
    table ran CUDA 11.3: no cuBLASLt workspace at all."""
    assert cublaslt_workspace_bytes({'TORCH_CUBLASLT_UNIFIED_WORKSPACE': '0'}, T112) == 0
    allocations = list(cuda_allocations('matmul lt', [], True, (8, 6), {}, T112))
    assert allocations == [(SMALL_WORKSPACE, 'kept', 'cublas backward')]
    cuda_11_6 = Software((1, 12, 1), (11, 6), (8, 3, 2))
    assert list(cuda_allocations('matmul lt', [], True, (8, 6), {}, cuda_11_6))[1:] == [(MiB, 'op', 'cublaslt call')]


def test_allocator_variable_per_release():
    """c10/core/AllocatorConfig.cpp AcceleratorAllocatorConfig::instance at v2.14.1 (PYTORCH_CUDA_ALLOC_CONF first);
    c10/cuda/CUDAAllocatorConfig.h CUDAAllocatorConfig::instance at v2.9.1 (the wheel's header: PYTORCH_CUDA_ALLOC_CONF
    only; its PYTORCH_ALLOC_CONF reader, AcceleratorAllocatorConfig, serves only the pinned host allocator);
    c10/cuda/CUDACachingAllocator.cpp CachingAllocatorConfig::parseArgs at v1.12.1 (PYTORCH_CUDA_ALLOC_CONF only)."""
    assert allocator_variables(T214) == ('PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_HIP_ALLOC_CONF', 'PYTORCH_ALLOC_CONF')
    assert allocator_variables(T291) == allocator_variables(T112) == ('PYTORCH_CUDA_ALLOC_CONF',)
    newer_only = {'PYTORCH_ALLOC_CONF': 'expandable_segments:True'}
    assert allocator_config(newer_only, T214).expandable_segments
    assert allocator_config(newer_only, T291) == allocator_config(newer_only, T112) == AllocatorConfig()
    assert expandable_setting({}, T214) == ('PYTORCH_ALLOC_CONF', 'expandable_segments:True')
    assert expandable_setting({}, T291) == ('PYTORCH_CUDA_ALLOC_CONF', 'expandable_segments:True')
    with pytest.raises(UsageError, match='torch 1.12.1 has no expandable segments'):
        expandable_setting({}, T112)


@pytest.mark.parametrize('setting, takes', [
    # (setting, (1.12.1, 2.9.1, 2.14.1) accept it)
    ('expandable_segments:True', (False, True, True)),
    ('max_split_size_mb:20', (False, False, True)),
    ('max_split_size_mb:21', (True, True, True)),
    ('max_non_split_rounding_mb:40', (False, True, True)),
    ('large_segment_size_mb:32', (False, False, True)),
    ('roundup_power2_divisions:4', (True, True, True)),
    ('roundup_power2_divisions:[256:1,>:4]', (False, True, True)),
    ('garbage_collection_threshold:0.6', (True, True, True)),
    ('backend:native', (False, True, True)),
    ('per_process_memory_fraction:1.0', (False, False, True)),
    ('pinned_num_register_threads:8', (False, True, True)),
    ('foo:1', (False, False, False)),
    ('expandable_segments', (True, False, False)),  # 1.12.1 skips an option without a value
    ('max_split_size_mb:64,\texpandable_segments:True', (False, False, True)),  # 2.9.1's lexer drops spaces only
])
def test_allocator_options_each_release_knows(setting, takes):
    """c10/cuda/CUDACachingAllocator.cpp CachingAllocatorConfig::parseArgs at v1.12.1 (options split by `[\\s,]+`,
    key and value by `[:]+`, three keys, `max_split_size_mb` > 20; its wheel's libc10_cuda.so holds these strings);
    c10/cuda/CUDAAllocatorConfig.cpp lexArgs / parseArgs at v2.9.1 (its wheel's libc10_cuda.so: the key names and
    "must be > 20"); c10/core/AllocatorConfig.cpp and c10/cuda/CUDAAllocatorConfig.cpp at v2.14.1 (checked against
    the installed parser in test_allocator_config.py)."""
    for software, accepted in zip((T112, T291, T214), takes):
        try:
            parse_allocator_conf(setting, 'PYTORCH_CUDA_ALLOC_CONF', software)
            ours = True
        except UsageError as e:
            message = str(e)
            assert '\n' not in message and 'torch 2.14.1' not in message or software is T214, message
            ours = False
        assert ours == accepted, (setting, software.torch)


def test_a_refusal_names_the_release_it_models():
    """c10/cuda/CUDAAllocatorConfig.cpp parseArgs (v2.9.1) and c10/cuda/CUDACachingAllocator.cpp parseArgs
    (v1.12.1): "Unrecognized CachingAllocator option"; the message names the modelled release, never the pin."""
    for software, name in ((T112, 'torch 1.12.1'), (T291, 'torch 2.9.1'), (T214, 'torch 2.14.1')):
        with pytest.raises(UsageError) as e:
            allocator_config({'PYTORCH_CUDA_ALLOC_CONF': 'large_segment_size_mb:32,foo:1'}, software)
        assert name in str(e.value) and ("'large_segment_size_mb'" in str(e.value)) == (software is not T214)
    assert 'expandable_segments' not in known_options(T112) and 'large_segment_size_mb' not in known_options(T291)


def test_one_division_leaves_requests_unrounded_in_torch_1_12():
    """c10/cuda/CUDACachingAllocator.cpp at v1.12.1: round_size calls roundup_power2_next_division for any count
    above 0 and it returns the size for a count of 1 (read in torch_musa's port of that era); from v2.x round_size
    asks for a count above 1, and a count of 1 rounds to 512 B."""
    old = allocator_config({'PYTORCH_CUDA_ALLOC_CONF': 'roundup_power2_divisions:1'}, T112)
    new = allocator_config({'PYTORCH_CUDA_ALLOC_CONF': 'roundup_power2_divisions:1'}, T214)
    assert old.round_size(1000) == 1000 and old.round_size(100) == 512
    assert new.round_size(1000) == 1024
    four = {'PYTORCH_CUDA_ALLOC_CONF': 'roundup_power2_divisions:4'}
    assert allocator_config(four, T112).round_size(5 * MiB + 1) == allocator_config(four, T214).round_size(5 * MiB + 1)


def test_cuda_autocast_float32_lists_per_release():
    """aten/src/ATen/autocast_mode.h AT_FORALL_FP32 / AT_FORALL_FP32_SET_OPT_DTYPE at v2.14.1 (installed) and v2.9.1
    (its wheel's header: no rms_norm); aten/src/ATen/autocast_mode.cpp at v1.12.1 (the CUDA registrations in its
    wheel's libtorch_cpu.so: no logsumexp, no upsample_*, no linalg_vector_norm / linalg_matrix_norm)."""
    assert F.rms_norm in cuda_float32_functions(T214) and F.rms_norm not in cuda_float32_functions(T291)
    assert torch.logsumexp in cuda_float32_functions(T291) and torch.logsumexp not in cuda_float32_functions(T112)
    assert F.layer_norm in cuda_float32_functions(T112) and F.group_norm in cuda_float32_functions(T112)
    assert casts_upsampling(T291) and not casts_upsampling(T112)
    assert torch.linalg.vector_norm in cuda_float32_output_functions(T291)
    assert torch.linalg.vector_norm not in cuda_float32_output_functions(T112)
    assert F.softmax in cuda_float32_output_functions(T112) and torch.norm in cuda_float32_output_functions(T112)
    assert cuda_float32_functions() == cuda_float32_functions(PINNED)

    x = torch.randn(2, 8, 4, 4, dtype=torch.float16)
    with torch.autocast('cpu', dtype=torch.float16), CudaAutocastCasts(T112):
        assert F.interpolate(x, scale_factor=2, mode='bilinear').dtype == torch.float16
        assert F.layer_norm(x, (4,)).dtype == torch.float32
    with torch.autocast('cpu', dtype=torch.float16), CudaAutocastCasts(T291):
        assert F.interpolate(x, scale_factor=2, mode='bilinear').dtype == torch.float32
        assert F.rms_norm(x, (4,)).dtype == torch.float16
