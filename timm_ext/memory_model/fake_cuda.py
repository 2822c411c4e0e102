"""A named card as torch, inductor and Triton see it, in a process that has no GPU: the device a compiled plan targets.

Inductor decides for the device it compiles for: whether convolutions run channels-last (`GraphLowering.
decide_layout_opt`), how reductions split (the card's multiprocessors), which Triton kernels and block sizes it picks
(shared memory, registers, the compute capability). `fake_cuda(card)` makes the queries behind those decisions answer
as `card` would, so that inductor's lowering, its Scheduler and its wrapper code generation run for that card on CUDA
fake tensors (`timm_ext.memory_model.inductor_capture`). Nothing runs on a device: every tensor is fake and no Triton
kernel is compiled.

What is patched, each undone when the block ends (the trace runs it in the estimate's own child process, never in one
that uses a real GPU):

* `torch.cuda`'s device queries (`is_available`, `device_count`, `current_device`, `get_device_properties`,
  `get_device_capability`, `set_device`, the device guard's `_exchange_device`, stream capture, the RNG state that
  inductor saves around code generation): one device, the card;
* TorchDynamo's `CudaInterface`, which bound the same functions when it was defined, and its cache of properties;
* Triton's active driver, whose real one loads libcuda: a driver answering the card's target (`sm_XY`) and limits;
* inductor's pattern-matcher set-up and its uniform-value constant folder, which evaluate small graphs with real
  tensors on the graph's device: they run on the CPU instead (the patterns are aten structure; the folded values are
  the same);
* the caches of what the device is and can do (`DeviceProperties.create`, `is_big_gpu`, `has_triton`), emptied on
  entry and exit.

The per-architecture limits come from the CUDA C++ Programming Guide's table of technical specifications per compute
capability (`ARCH_LIMITS_SOURCE`); the multiprocessor count is the card's own (`Card.multiprocessors`).
"""
import contextlib
import types
from typing import Iterator, Tuple

import torch

from .cards import Card

__all__ = ['fake_cuda', 'device_properties', 'ARCH_LIMITS_SOURCE']

ARCH_LIMITS_SOURCE = ('https://docs.nvidia.com/cuda/cuda-c-programming-guide/'
                      '#features-and-technical-specifications-technical-specifications-per-compute-capability')
# compute capability -> (threads per multiprocessor, shared memory per block with opt-in, shared memory per
# multiprocessor), bytes; 65536 registers per multiprocessor and 1024 threads per block on all of them
_ARCH_LIMITS = {
    (7, 5): (1024, 64 << 10, 64 << 10),
    (8, 0): (2048, 163 << 10, 164 << 10),
    (8, 6): (1536, 99 << 10, 100 << 10),
    (8, 7): (2048, 163 << 10, 164 << 10),
    (8, 9): (1536, 99 << 10, 100 << 10),
    (9, 0): (2048, 227 << 10, 228 << 10),
    (10, 0): (2048, 227 << 10, 228 << 10),
    (12, 0): (1536, 99 << 10, 100 << 10),
}


def device_properties(card: Card) -> types.SimpleNamespace:
    """What `torch.cuda.get_device_properties` would answer on `card`."""
    threads, shared_optin, shared_sm = _ARCH_LIMITS[card.compute_capability]
    major, minor = card.compute_capability
    return types.SimpleNamespace(
        name=card.title, major=major, minor=minor, total_memory=card.reported_bytes,
        multi_processor_count=card.multiprocessors, warp_size=32, max_threads_per_block=1024,
        max_threads_per_multi_processor=threads, regs_per_multiprocessor=65536,
        shared_memory_per_block=48 << 10, shared_memory_per_block_optin=shared_optin,
        shared_memory_per_multiprocessor=shared_sm, is_integrated=False, gcnArchName='', uuid='fake',
        L2_cache_size=0)


def _set(stack: contextlib.ExitStack, owner: object, name: str, value: object) -> None:
    """`owner.name = value` until the stack closes."""
    before = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    stack.callback(setattr, owner, name, before)


def _clear_property_caches() -> None:
    from torch._dynamo import device_interface
    from torch._inductor import utils
    from torch._inductor.runtime.hints import DeviceProperties
    from torch.utils import _triton
    _triton.has_triton.cache_clear()  # asked once on the CPU graph already: no CUDA device then
    _triton.has_datacenter_blackwell_tma_device.cache_clear()
    _triton._device_supports_tensor_descriptor.cache_clear()
    device_interface.caching_worker_device_properties.pop('cuda', None)
    device_interface.caching_worker_current_devices.pop('cuda', None)
    DeviceProperties.__dict__['create'].__func__.cache_clear()
    utils.is_big_gpu.cache_clear()


def _triton_driver(props: types.SimpleNamespace, capability: Tuple[int, int]):
    """Triton's CUDA driver without libcuda: the target and the limits of the card."""
    from triton.backends.nvidia.driver import CudaDriver

    class CardDriver(CudaDriver):
        def __init__(self):  # the real one opens libcuda here; what it would ask the device, the card answers
            self.utils = types.SimpleNamespace(get_device_properties=lambda device=0: {
                'max_shared_mem': props.shared_memory_per_block_optin,
                'multiprocessor_count': props.multi_processor_count, 'max_num_regs': props.regs_per_multiprocessor,
                'warpSize': props.warp_size, 'sm_clock_rate': 0, 'mem_clock_rate': 0, 'mem_bus_width': 0})
            self.get_current_device = lambda: 0
            self.set_current_device = lambda device: None
            self.get_current_stream = lambda device=0: 0
            self.get_device_capability = lambda device=0: capability

    return CardDriver()


@contextlib.contextmanager
def _folded_on_cpu(stack: contextlib.ExitStack) -> Iterator[None]:
    """Inductor's pattern set-up and constant folding run real tensors: on the CPU, whatever the graph's device."""
    from torch._inductor.fx_passes import fuse_attention, joint_graph, misc_patterns, pad_mm
    for module, name in ((fuse_attention, '_sfdp_init'), (pad_mm, '_pad_mm_init'),
                         (misc_patterns, '_misc_patterns_init')):
        init = getattr(module, name)
        _set(stack, module, name, lambda input_device=None, _init=init: _init(torch.device('cpu')))
    folder = joint_graph.UniformValueConstantFolder
    deduce = folder.__dict__['_deduce_value']

    def deduce_on_cpu(self, node):
        device = node.kwargs.get('device')
        if device is None or torch.device(device).type != 'cuda':
            return deduce(self, node)
        kwargs = node.kwargs
        node.kwargs = {**kwargs, 'device': torch.device('cpu')}
        try:
            return deduce(self, node)
        finally:
            node.kwargs = kwargs
    _set(stack, folder, '_deduce_value', deduce_on_cpu)
    yield


@contextlib.contextmanager
def fake_cuda(card: Card) -> Iterator[types.SimpleNamespace]:
    """While the block runs, the process has one CUDA device: `card` (see the module doc). Yields its properties.

    Raises:
        RuntimeError: This process has used a real GPU (its queries must keep answering for it).
    """
    from torch._dynamo.device_interface import CudaInterface
    if torch.cuda.is_initialized():
        raise RuntimeError('a compiled CUDA plan generates its graphs for a card that is not here, which a process '
                           'that has used a real GPU cannot do; plan it from a process that has not')
    from triton.runtime.driver import driver

    props = device_properties(card)
    capability = card.compute_capability
    with contextlib.ExitStack() as stack:
        queries = dict(is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
                       get_device_properties=lambda device=None: props,
                       get_device_capability=lambda device=None: capability,
                       set_device=lambda device: None, _exchange_device=lambda device: 0,
                       _maybe_exchange_device=lambda device: 0, is_current_stream_capturing=lambda: False,
                       # inductor keeps the RNG state across code generation (`preserve_rng_state`): none to keep
                       get_rng_state=lambda device='cuda': torch.zeros(16, dtype=torch.uint8),
                       set_rng_state=lambda state, device='cuda': None)
        for name, query in queries.items():
            _set(stack, torch.cuda, name, query)
        for name in ('is_available', 'device_count', 'current_device', 'get_device_properties', 'set_device'):
            _set(stack, CudaInterface, name, staticmethod(queries[name]))
        _set(stack, CudaInterface, 'exchange_device', staticmethod(queries['_exchange_device']))
        _set(stack, CudaInterface, 'maybe_exchange_device', staticmethod(queries['_maybe_exchange_device']))
        card_driver = _triton_driver(props, capability)
        _set(stack, driver, '_active', card_driver)
        _set(stack, driver, '_default', card_driver)
        stack.enter_context(_folded_on_cpu(stack))
        _clear_property_caches()
        stack.callback(_clear_property_caches)
        yield props
