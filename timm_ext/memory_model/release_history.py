"""Where each versioned rule of the memory model changed: the release, the library, and the source it was read from.

A rule of the model is a function of the run's torch, CUDA and cuDNN (`versions.Software`), not of the nearest release
the model was calibrated on: each rule module asks `in_force(CHANGE, software)` for the changes it depends on, and a
change holds the first release with its new behaviour. cuDNN's changes are decided by the run's cuDNN alone, torch's
by the run's torch alone.

Each `Change` names its source: the pull request(s) and file, and the evidence for the two sides (a tag's file, a
wheel's binary or headers read here, or a pull request's merge date against the release branch cut). Where the
release cannot be pinned (`Change.window` is set: the last release known to behave the old way and the first known to
behave the new way), `since` is the side assumed, and a plan for a torch inside that window says so
(`assumed_changes`).

The releases read directly (their wheels, in earlier work: `versions.RELEASES`) are 1.12.1, 2.9.1 and 2.14.1.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

__all__ = ['Change', 'CHANGES', 'in_force', 'assumed_changes', 'dotted', 'TORCH_COMPILE',
           'SDPA', 'SDPA_MASKED_EFFICIENT', 'FLASH_V2', 'CUDNN_SDPA_PREFERRED_25', 'CUDNN_SDPA_DEPRIORITIZED_251',
           'CUDNN_SDPA_PREFERRED_29', 'CUDNN_SDPA_RULES_210', 'MATH_SDPA_FLOAT32', 'AUTOCAST_INFERENCE_NO_CACHE',
           'DEPTHWISE_64BIT_TO_CUDNN', 'DEPTHWISE_CHANNELS_LAST_REFUSED', 'DEPTHWISE_CHANNELS_LAST_FROM_915',
           'CUDNN_64BIT_FROM', 'CUDNN_DEPTHWISE_BROKEN_ABOVE', 'CUDNN_DEPTHWISE_FIXED_FROM', 'AUTOCAST_LISTS_20',
           'AUTOCAST_RMS_NORM', 'CUBLAS_WORKSPACE_ALLOCATOR', 'CUBLAS_WIDE_DEFAULT', 'CUBLASLT_UNIFIED',
           'CUBLASLT_KEPT_WORKSPACE', 'ALLOCATOR_BACKEND', 'ALLOCATOR_EXPANDABLE', 'ALLOCATOR_ACCELERATOR_CONFIG']

Version = Tuple[int, ...]


def dotted(version: Version) -> str:
    """'2.9.1' for (2, 9, 1)."""
    return '.'.join(map(str, version))


@dataclass(frozen=True)
class Change:
    """One change of behaviour between releases.

    Attributes:
        key: A short name for tests and notes.
        what: The behaviour from `since` on.
        library: 'torch' or 'cudnn': whose version decides.
        since: The first release with the new behaviour (where `window` is set, the side assumed).
        source: The pull request(s) and file the behaviour was read in.
        evidence: How the two sides were established (tags, wheels, merge dates).
        window: Where the release is not pinned: (the last release known old, the first known new); None: pinned.
    """
    key: str
    what: str
    library: str
    since: Version
    source: str
    evidence: str
    window: Optional[Tuple[Version, Version]] = None

    def describe(self) -> str:
        """One line: the change, its release (or the window and the side assumed) and its source."""
        when = (f'from {self.library} {dotted(self.since)}' if self.window is None else
                f'from {self.library} {dotted(self.since)} (assumed: it changed between {dotted(self.window[0])} '
                f'and {dotted(self.window[1])})')
        return f'{self.what} {when}; {self.source}'


def _torch(key, what, since, source, evidence, window=None) -> Change:
    return Change(key, what, 'torch', since, source, evidence, window)


# torch.compile itself (timm_ext.memory_model.compiled_step)
TORCH_COMPILE = _torch('torch-compile', 'torch.compile exists (TorchDynamo and inductor ship in torch)', (2, 0, 0),
                       'torch/__init__.py (torch.compile), torch/_dynamo, torch/_inductor',
                       'torch 2.0.0 release notes introduce torch.compile; the 1.12.1 wheel has neither torch.compile '
                       'nor torch._dynamo')
# scaled_dot_product_attention (timm_ext.memory_model.kernels_attention)
SDPA = _torch('sdpa', 'torch.nn.functional.scaled_dot_product_attention exists', (2, 0, 0),
              'torch/nn/functional.py (the public op; 1.12/1.13 have only the private _scaled_dot_product_attention)',
              'v1.12.1 wheel read (no public op); torch 2.0.0 release notes introduce it')
SDPA_MASKED_EFFICIENT = _torch(
    'sdpa-masked-efficient', 'the memory-efficient kernel takes an attn_mask', (2, 1, 0),
    'aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (check_for_attn_mask of the memory-efficient path)',
    'torch 2.1.0 release notes (arbitrary masks for memory-efficient attention); v2.0 refuses masks',
    window=((2, 0, 0), (2, 9, 1)))
FLASH_V2 = _torch('flash-v2', 'flash attention is flash-attention 2 (head sizes up to 256)', (2, 2, 0),
                  'aten/src/ATen/native/transformers/cuda/flash_attn/ (flash-attention 2 vendored)',
                  'torch 2.2.0 release notes; 2.0 and 2.1 ran flash-attention 1 (head sizes up to 128)',
                  window=((2, 0, 0), (2, 9, 1)))
CUDNN_SDPA_PREFERRED_25 = _torch(
    'cudnn-sdpa-preferred-2.5', 'cuDNN attention is tried first on sm90 (H100)', (2, 5, 0),
    'sdp_utils.cpp priority_order (torch 2.5.0 release notes: cuDNN SDPA on by default for H100)',
    'torch 2.5.0 release notes')
CUDNN_SDPA_DEPRIORITIZED_251 = _torch(
    'cudnn-sdpa-deprioritized-2.5.1', 'cuDNN attention is no longer tried first', (2, 5, 1),
    'sdp_utils.cpp priority_order (the 2.5.1 patch release deprioritized cuDNN attention after correctness reports)',
    'torch 2.5.1 release notes (cuDNN attention made opt-in); the 2.9.1 wheel prefers it only behind its own checks '
    '(CUDNN_SDPA_PREFERRED_29)')
CUDNN_SDPA_PREFERRED_29 = _torch(
    'cudnn-sdpa-preferred-2.9', 'cuDNN attention first on sm90/sm100 when built against cuDNN 9.9+, unless '
    'TORCH_CUDNN_SDPA_PREFERRED=0', (2, 9, 0), 'sdp_utils.cpp check_prefer_cudnn_attention',
    'the 2.9.1 wheel disassembled; assumed from 2.9.0', window=((2, 8, 0), (2, 9, 1)))
CUDNN_SDPA_RULES_210 = _torch(
    'cudnn-sdpa-2.14-rules', 'cuDNN attention first on sm9x/sm10x when the runtime cuDNN is newer than 9.15.0 (unless '
    'TORCH_CUDNN_SDPA_DEPRIORITIZED=1); head sizes up to 256 and at most 65535 batch rows', (2, 10, 0),
    'sdp_utils.cpp check_prefer_cudnn_attention, check_cudnn_tensor_shapes',
    'the 2.9.1 and 2.14.1 wheels disassembled', window=((2, 9, 1), (2, 14, 1)))
MATH_SDPA_FLOAT32 = _torch(
    'math-sdpa-float32', "SDPA's math path computes float16/bfloat16 inputs in float32 (unless "
    'torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True))', (2, 5, 0),
    'pytorch#128922 and #135964, aten/src/ATen/native/transformers/attention.cpp (_scaled_dot_product_attention_math)',
    '#128922 merged 2024-07 and #135964 2024-09, both before the 2.5 branch cut; the 2.9.1 wheel has the switch')
# autocast (timm_ext.memory_model.autocast_casts)
AUTOCAST_INFERENCE_NO_CACHE = _torch(
    'autocast-inference-no-cache', "autocast does not cache its half-precision weight copies under inference_mode",
    (2, 10, 0), 'pytorch#165068, aten/src/ATen/autocast_mode.cpp (cached_cast)',
    'a stored autocast_mode.cpp without the test (cached_cast caches every float32 leaf that requires grad); the '
    'installed 2.14.1 measured here: a Linear called three times casts its weight once under no_grad, three times '
    'under inference_mode', window=((2, 9, 1), (2, 14, 1)))
AUTOCAST_LISTS_20 = _torch(
    'autocast-lists-2.0', 'CUDA autocast casts logsumexp and the upsampling kernels to float32 and gives '
    'linalg_vector_norm / linalg_matrix_norm a float32 result', (2, 0, 0),
    'aten/src/ATen/autocast_mode.h (AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE)',
    'the 1.12.1 wheel lacks them, the 2.9.1 wheel has them', window=((1, 12, 1), (2, 9, 1)))
AUTOCAST_RMS_NORM = _torch('autocast-rms-norm', 'CUDA autocast casts rms_norm to float32', (2, 10, 0),
                           'aten/src/ATen/autocast_mode.h (AT_FORALL_FP32)',
                           'the 2.9.1 wheel lacks it, the 2.14.1 wheel has it', window=((2, 9, 1), (2, 14, 1)))
# depthwise convolutions (timm_ext.memory_model.kernel_limits)
DEPTHWISE_64BIT_TO_CUDNN = _torch(
    'depthwise-64bit-cudnn', 'a depthwise convolution past 32-bit indexing goes to cuDNN (cuDNN 9.3+, its v8 API on) '
    "instead of PyTorch's 32-bit kernel", (2, 9, 0),
    'pytorch#153101 and #156140, aten/src/ATen/native/Convolution.cpp (ConvParams::use_cudnn_depthwise); '
    'before them the kernel raised (pytorch#155225)',
    'the 1.12.1 wheel (no 32-bit test) and the 2.9.1 wheel (the test and its warning) disassembled; assumed from 2.9.0 '
    'as the issue of this rule reads the history', window=((2, 8, 0), (2, 9, 1)))
DEPTHWISE_CHANNELS_LAST_REFUSED = _torch(
    'depthwise-channels-last-refused', 'a channels-last depthwise convolution past 32-bit indexing is refused by '
    'cuDNN above 9.10.0', (2, 9, 0), 'pytorch#163171, Convolution.cpp (use_cudnn_depthwise)',
    'merged 2025-09 into the 2.9 release; the 2.9.1 wheel disassembled (`> 91000`)')
DEPTHWISE_CHANNELS_LAST_FROM_915 = _torch(
    'depthwise-channels-last-915', 'the refusal stops at cuDNN 9.15 (refused only from 9.10.1 to 9.14)', (2, 10, 0),
    'pytorch#168364, Convolution.cpp (use_cudnn_depthwise)',
    'merged 2025-11-22, before the 2.10 branch cut; the 2.14.1 wheel disassembled (`> 91000 && < 91500`)',
    window=((2, 9, 1), (2, 14, 1)))
CUDNN_64BIT_FROM = Change('cudnn-64bit', 'cuDNN runs convolutions past 32-bit indexing that cannot be split by '
                          'batch', 'cudnn', (9, 3, 0),
                          'pytorch#134890, Convolution.cpp (use_cudnn: cudnn_version >= 90300)',
                          'the 2.9.1 and 2.14.1 wheels disassembled (90300)')
CUDNN_DEPTHWISE_BROKEN_ABOVE = Change('cudnn-depthwise-64bit-broken', "cuDNN's 64-bit channels-last depthwise "
                                      'kernel is wrong', 'cudnn', (9, 10, 1), 'pytorch#163171 (works on 9.10.2 per '
                                      'its review, refused above 9.10.0 in code)', 'the 2.9.1 wheel disassembled')
CUDNN_DEPTHWISE_FIXED_FROM = Change('cudnn-depthwise-64bit-fixed', "cuDNN's 64-bit depthwise kernel is fixed",
                                    'cudnn', (9, 15, 0), 'pytorch#168364', 'the 2.14.1 wheel disassembled (91500)')
# cuBLAS / cuBLASLt workspaces (timm_ext.memory_model.kernels)
CUBLAS_WORKSPACE_ALLOCATOR = _torch(
    'cublas-workspace-allocator', "cuBLAS's workspace comes from the caching allocator, sized by "
    'CUBLAS_WORKSPACE_CONFIG, one per (handle, stream)', (2, 0, 0),
    'aten/src/ATen/cuda/CublasHandlePool.cpp (setWorkspaceForHandle, getChosenWorkspaceSize)',
    'the 1.12.1 wheel imports no cublasSetWorkspace, the 2.9.1 wheel does', window=((1, 12, 1), (2, 9, 1)))
CUBLAS_WIDE_DEFAULT = _torch(
    'cublas-wide-default', 'the default cuBLAS workspace is 32 MiB on compute capability majors 9 to 12 (2.9.1: on '
    '9.0 only)', (2, 10, 0), 'CublasHandlePool.cpp (parseChosenWorkspaceSize)',
    'the 2.9.1 and 2.14.1 wheels disassembled', window=((2, 9, 1), (2, 14, 1)))
CUBLASLT_KEPT_WORKSPACE = _torch(
    'cublaslt-kept-workspace', 'cuBLASLt keeps a workspace per (handle, stream) instead of allocating 1 MiB per call',
    (2, 0, 0), 'CublasHandlePool.cpp (getCUDABlasLtWorkspace); aten/src/ATen/cuda/CUDABlas.cpp (gemm_and_bias)',
    'the 1.12.1 wheel allocates per call, the 2.9.1 wheel keeps one', window=((1, 12, 1), (2, 9, 1)))
CUBLASLT_UNIFIED = _torch(
    'cublaslt-unified', "cuBLASLt shares cuBLAS's workspace by default (TORCH_CUBLASLT_UNIFIED_WORKSPACE)", (2, 10, 0),
    'CublasHandlePool.cpp (unified_cublas_and_lt_workspaces)', 'off in the 2.9.1 wheel, on in the 2.14.1 wheel',
    window=((2, 9, 1), (2, 14, 1)))
# the caching allocator's setting (timm_ext.memory_model.allocator_releases)
ALLOCATOR_BACKEND = _torch(
    'allocator-backend', "PYTORCH_CUDA_ALLOC_CONF is read by a tokenizer (CUDAAllocatorConfig's lexArgs) that knows "
    'backend:cudaMallocAsync and a flag is True or False', (2, 0, 0),
    'c10/cuda/CUDAAllocatorConfig.cpp (split out of CUDACachingAllocator.cpp with cudaMallocAsync support)',
    'the 1.12.1 wheel (regular expressions) and the 2.9.1 wheel (lexArgs) read', window=((1, 12, 1), (2, 9, 1)))
ALLOCATOR_EXPANDABLE = _torch('allocator-expandable', 'expandable_segments is an allocator option', (2, 1, 0),
                              'c10/cuda/CUDACachingAllocator.cpp (ExpandableSegment), CUDAAllocatorConfig.cpp',
                              'torch 2.1.0 release notes; absent from the 1.12.1 wheel, present in the 2.9.1 wheel')
ALLOCATOR_ACCELERATOR_CONFIG = _torch(
    'allocator-accelerator-config', "the device allocator reads c10's AcceleratorAllocatorConfig: "
    'PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF or PYTORCH_ALLOC_CONF, large_segment_size_mb and the other '
    '2.14.1 options', (2, 10, 0), 'c10/core/AllocatorConfig.cpp, c10/cuda/CUDAAllocatorConfig.cpp',
    'the 2.9.1 and 2.14.1 wheels read', window=((2, 9, 1), (2, 14, 1)))

CHANGES: Tuple[Change, ...] = (
    TORCH_COMPILE, SDPA, SDPA_MASKED_EFFICIENT, FLASH_V2, CUDNN_SDPA_PREFERRED_25, CUDNN_SDPA_DEPRIORITIZED_251,
    CUDNN_SDPA_PREFERRED_29, CUDNN_SDPA_RULES_210, MATH_SDPA_FLOAT32, AUTOCAST_INFERENCE_NO_CACHE, AUTOCAST_LISTS_20,
    AUTOCAST_RMS_NORM, DEPTHWISE_64BIT_TO_CUDNN, DEPTHWISE_CHANNELS_LAST_REFUSED, DEPTHWISE_CHANNELS_LAST_FROM_915,
    CUDNN_64BIT_FROM, CUDNN_DEPTHWISE_BROKEN_ABOVE, CUDNN_DEPTHWISE_FIXED_FROM, CUBLAS_WORKSPACE_ALLOCATOR,
    CUBLAS_WIDE_DEFAULT, CUBLASLT_KEPT_WORKSPACE, CUBLASLT_UNIFIED, ALLOCATOR_BACKEND, ALLOCATOR_EXPANDABLE,
    ALLOCATOR_ACCELERATOR_CONFIG,
)
assert len({change.key for change in CHANGES}) == len(CHANGES)


def _version_of(change: Change, software) -> Optional[Version]:
    return software.torch if change.library == 'torch' else software.cudnn


def in_force(change: Change, software) -> bool:
    """Whether `software` (a `versions.Software`) has the behaviour `change` introduced (no cuDNN: a cuDNN change
    is not in force)."""
    version = _version_of(change, software)
    return version is not None and tuple(version) >= change.since


def assumed_changes(software) -> List[str]:
    """One note per change whose release is not pinned and whose window holds the run's torch (strictly between the
    releases known old and new): the side the plan assumed."""
    notes = []
    for change in CHANGES:
        if change.window is None or change.library != 'torch':
            continue
        low, high = change.window
        if low < tuple(software.torch) < high:
            side = 'with' if in_force(change, software) else 'without'
            notes.append(f"{change.key} assumed {side} (it changed between torch {dotted(low)} and {dotted(high)}; "
                         f"taken as {dotted(change.since)})")
    return notes
