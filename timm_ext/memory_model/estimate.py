"""Know the batch before the run: train.py's own step traced on fake tensors, its peak memory fitted per category.

`estimate_memory` builds the run with train.py's builder (`timm_ext.train.stack`: model, task and loss with mixup, label
smoothing or distillation, optimizer, EMA, AMP, channels_last, grad checkpointing) and runs the probe trial's own update
(`timm_ext.train.trial_steps.trial_train_step`) on fake tensors (`torch._subclasses.FakeTensorMode`): shapes and dtypes
without storage, so no activation is allocated. `timm_ext.memory_model.live_bytes.LiveBytes` counts what each op would hold;
a warm-up update at batch 2 creates the optimizer state, then an update at each of `TRACE_BATCHES` gives the peak split
into weights, gradients, optimizer state, activations and temporaries. Each category is fitted linear in the batch size
(least squares), so `MemoryEstimate.peak(b)` is the sum of five lines plus what the device adds
(`timm_ext.memory_model.devices`).

The model is built for real (timm models read tensor values while they are built, which fake tensors refuse) and
then moved onto fake tensors (`to_empty`): the weights cost their real size once, the activations nothing. A model
whose forward reads tensor values (data-dependent shapes, `.item()`) or runs kernels fake tensors do not know cannot
be traced: `EstimateError` says so in one line and the caller probes without the estimate. float16's loss scaler is
left out of the trace (its overflow check reads a value; it holds two scalars and unscales in place).
"""
import argparse
import contextlib
import dataclasses
import functools
import logging
import time
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..child_process import call_uncapped
from ..errors import TimmExtError
from ..train.setup import with_values
from ..train.stack import build_optimizer, build_training_stack
from ..train.trial_steps import probe_input_size, trial_eval_forward, trial_loop, trial_train_step
from .autocast_casts import CudaAutocastCasts, caches_weights
from .cards import find_card
from .compiled_step import compile_problem, compiled_for_trace, generated_by, is_compile_error, unmodelled
from .devices import DeviceModel, device_model
from .estimate_result import EstimateError, MemoryEstimate
from .events import EventLog
from .fake_weights import fake_weights
from .kernel_limits import KernelSizes
from .kernels_attention import sdpa_available
from .live_bytes import CATEGORIES, LiveBytes
from .predict import CudaReplay, trace_logs
from .skipped_init import SkippedInit
from .step_facts import FlopCount, weight_storages
from .versions import run_software

__all__ = ['TRACE_BATCHES', 'STEPS', 'EstimateError', 'MemoryEstimate', 'estimate_memory', 'run_device', 'in_child']

TRACE_BATCHES = (16, 32, 64)  # three sizes, a line per category; from 16 on CPU convolutions take NNPACK (oneDNN off)
WARMUP_BATCH = 2  # the warm-up update that creates the optimizer state (batch norm needs 2 samples)
CPU = torch.device('cpu')
# what is traced: train.py's update; its evaluation between epochs (forward only, the optimizer state resident);
# validate.py's forward (the weights alone resident)
STEPS = ('train', 'eval', 'validate')


def _fit_line(points: Dict[int, int]) -> Tuple[float, float]:
    """Least-squares line (intercept, slope) through (batch, bytes) points."""
    sizes = sorted(points)
    mean_b = sum(sizes) / len(sizes)
    mean_v = sum(points.values()) / len(sizes)
    slope = sum((b - mean_b) * (points[b] - mean_v) for b in sizes) / sum((b - mean_b) ** 2 for b in sizes)
    return mean_v - slope * mean_b, slope


@contextlib.contextmanager
def _attention_of(device: DeviceModel):
    """timm's attention as the planned release runs it: through F.scaled_dot_product_attention only where that
    release has it (`kernels_attention.sdpa_available`; torch 1.12 ran timm's own matmul-softmax-matmul)."""
    if device.name != 'cuda' or sdpa_available(device.software):
        yield
        return
    from timm.layers import config
    before = config._USE_FUSED_ATTN
    config.set_fused_attn(False)  # read when each attention module is built
    try:
        yield
    finally:
        config._USE_FUSED_ATTN = before


def _trace(args: argparse.Namespace, device: DeviceModel, batches: Sequence[int], step_kind: str) -> MemoryEstimate:
    """`estimate_memory` in this process (which cannot fork CPU trials afterwards)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    started = time.perf_counter()
    # no collective (its buffers are modelled apart), compiled below (`compiled_for_trace`), the device's autocast
    # dtype on CPU kernels
    estimate_args = with_values(args, sync_bn=False, torchcompile=None, device='cpu')
    lr = args.lr or args.lr_base
    with SkippedInit(), _attention_of(device):  # the weights' values are replaced by fake storage: not written
        stack = build_training_stack(estimate_args, CPU, lr=lr, with_data=False, compile_model=False, ddp=False)
    if device.name == 'cuda' and args.model_ema_force_cpu:  # its copy and its updates live on the host, not the card
        stack.task.trainable_module_ema = None
    input_size = probe_input_size(args, stack.data_config)
    eval_input_size = tuple(stack.data_config['input_size'])  # train.py's eval loader: the model's input size
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # CUDA autocast's float32 ops replayed under CPU autocast (they only act while autocast is on)
    # and its weight cache as the release keeps it: evaluation forwards run inference_mode (`caches_weights`)
    cache = step_kind == 'train' or caches_weights(device.software, inference_mode=True)
    casts = CudaAutocastCasts(device.software, cache) if device.name == 'cuda' else contextlib.nullcontext()
    kernels = KernelSizes() if device.name == 'cuda' else None
    traced: Dict[int, Dict[str, int]] = {}
    flops, counted_at = FlopCount(), max(batches) if step_kind == 'train' else None  # only the savers read FLOPs
    # train.py's --torchcompile, before the steps take the task's modules (`timm_ext.memory_model.compiled_step`)
    compiled = compiled_for_trace(stack.task, args.torchcompile, device.name, device.card) if args.torchcompile \
        else contextlib.nullcontext()
    try:
        with mode, compiled:
            fake_weights(stack.task, CPU)
            stack = dataclasses.replace(stack, optimizer=build_optimizer(estimate_args, stack.task, lr),
                                        grad_scaler=None)
            train_step = trial_train_step(args, stack, trial_loop(args, stack, CPU), input_size, CPU)
            # a forward traced under no_grad: inference_mode would hide the temporaries inside composite ops
            step = train_step if step_kind == 'train' else trial_eval_forward(args, stack, eval_input_size, CPU,
                                                                              no_grad=torch.no_grad)
            params = [p for p in stack.task.get_trainable_module().parameters() if p.requires_grad]
            weights = [*stack.task.parameters(), *stack.task.buffers()]
            storages = weight_storages(weights, params, getattr(stack.task, 'trainable_module_ema', None))
            if device.name == 'cuda':  # the ordered log the allocator replay reads
                modules = None if args.torchcompile else dict(stack.task.named_modules())
                tracker = EventLog(stack.task.parameters(), weights, modules, allocated=device.allocated)
            else:
                tracker = LiveBytes(stack.task.parameters(), weights, device.allocated, device.workspace, device.kept)
            order, steps = [], {}
            try:
                with kernels or contextlib.nullcontext(), tracker, casts:
                    if step_kind != 'validate':  # the optimizer state exists when train.py trains or evaluates
                        start = tracker.mark() if device.name == 'cuda' else 0
                        with _eager_update(args, step_kind):
                            train_step(WARMUP_BATCH)
                        order.append((start, tracker.mark() if device.name == 'cuda' else 0))
                    for batch_size in batches:
                        tracker.reset_peak()
                        start = tracker.mark() if device.name == 'cuda' else 0
                        # the FLOPs counted in the largest traced step (the counter adds no op to the log)
                        with flops if batch_size == counted_at else contextlib.nullcontext():
                            step(batch_size)
                        steps[batch_size] = start, tracker.mark() if device.name == 'cuda' else 0
                        order.append(steps[batch_size])
                        traced[batch_size] = dict(tracker.peak)
            finally:
                tracker.remove_hooks()
    except Exception as e:  # any op fake tensors cannot run: the caller falls back to real trials
        text = ' '.join(str(e).split())[:200]
        if args.torchcompile and is_compile_error(e):
            raise EstimateError(f'torch.compile ({args.torchcompile}) could not compile {args.model} for the trace '
                                f'({type(e).__name__}: {text})') from None
        raise EstimateError(f'{args.model} cannot be traced on fake tensors ({type(e).__name__}: {text})') from None
    lines = {name: _fit_line({b: split[name] for b, split in traced.items()}) for name in CATEGORIES}
    shown = input_size if step_kind == 'train' else eval_input_size
    describe = (f'model {args.model} at input {"x".join(map(str, shown))}, '
                f'{stack.amp.dtype or stack.model_dtype or torch.float32}'.replace('torch.', '')
                + (f', optimizer {args.opt}' if step_kind == 'train' else ', forward only')
                + (f', torch.compile {args.torchcompile}' if args.torchcompile else ''))
    grad_bytes = sum(device.allocated(None, (), p.numel() * p.element_size()) for p in params)
    kernel_sizes = {name: size / max(batches) for name, size in kernels.sizes.items()} if kernels else {}
    log = trace_logs(steps, tracker.events, tracker.names, order) if device.name == 'cuda' else None
    return MemoryEstimate(lines, traced, device, describe, time.perf_counter() - started, grad_bytes, kernel_sizes,
                          CudaReplay(log) if log else None, flops.total / max(batches), storages,
                          *_compiled_notes(args, device))


def _eager_update(args: argparse.Namespace, step_kind: str) -> contextlib.AbstractContextManager:
    """The warm-up update of an evaluation's trace, run eager where the model is compiled: it is there for the
    optimizer state, gradients and weights it leaves, which a compiled update leaves the same; compiled, it compiled
    the training forward and backward a second time (the training trace's work: resnet50's plan 47.5 s, now 41.5)."""
    if args.torchcompile and step_kind != 'train':
        return torch.compiler.set_stance('force_eager')
    return contextlib.nullcontext()


def _compiled_notes(args: argparse.Namespace, device: DeviceModel) -> Tuple[List[str], str]:
    """A compiled step's (what is not modelled, how its graphs were made) for the plan (`compiled_step`)."""
    if not args.torchcompile:
        return [], ''
    return (unmodelled(args.torchcompile, args.torchcompile_mode, device.name, device.card),
            generated_by(args.torchcompile, device.name, device.card, device.software))


def in_child(fn: Callable[..., dict], *args: object) -> Optional[dict]:
    """Run `fn(*args)` in a forked child and return its JSON-able answer (None when the child died without one).

    Why: a fake-tensor backward starts autograd's threads, and a process that has run them cannot fork the probe's CPU
    trials any more (torch refuses autograd in such a child), so every trace runs in a child of its own. A caller
    that has run a backward already (a notebook, a larger script) has nothing left to protect and its children could
    not trace: there `fn` runs in this process. The probe asks for its estimate only once an asked size failed
    (`timm_ext.probe.search.search_batch_size`), under its CPU cap: the trace runs with the soft limit lifted to the
    hard one, as its weights and imports are no trial's memory.
    """
    return call_uncapped(fn, *args)


def _traced_reply(args: argparse.Namespace, device_type: str, onednn: bool, batches: Sequence[int],
                  step_kind: str) -> dict:
    """`estimate_memory`'s child: the trace as JSON (its error's text when it cannot be traced)."""
    mkldnn = torch.backends.mkldnn.enabled
    if device_type == 'cpu':
        torch.backends.mkldnn.enabled = onednn  # the convolution backends the trace asks about are the run's
    try:
        # what torch warns while the step is traced (a compiled rms_norm given a float32 weight under autocast, say)
        # is the run's to print, not the plan's
        # and what its loggers print (TorchDynamo logs a failed guard at ERROR before raising it) reaches the plan as
        # the trace's one-line error
        quiet = logging.root.manager.disable
        logging.disable(logging.ERROR)
        with warnings.catch_warnings():
            warnings.filterwarnings('ignore', category=UserWarning, module=r'torch\.')
            return _trace(args, run_device(args, device_type, onednn), batches, step_kind).to_json()
    except TimmExtError as error:  # it cannot be traced, or the run cannot be built as asked (an invalid tag)
        return dict(error=str(error))
    finally:
        logging.disable(quiet)
        torch.backends.mkldnn.enabled = mkldnn  # in-process (`in_child`), the caller's setting again


def run_device(args: argparse.Namespace, device_type: str, onednn: bool = False) -> DeviceModel:
    """The device model of the run `args` plans: on CUDA its card (`--gpu`) and its software (`--software`, else
    the installed torch's: `timm_ext.memory_model.versions.run_software`)."""
    compiled = args.torchcompile == 'inductor'
    if device_type != 'cuda':
        return device_model(device_type, onednn, compiled=compiled)
    card = find_card(args.gpu) if getattr(args, 'gpu', None) else None
    software, line = run_software(getattr(args, 'software', None))
    return device_model(device_type, onednn, card, compiled, software, line)


def estimate_memory(args: argparse.Namespace, device_type: str, onednn: bool = False,
                    batches: Sequence[int] = TRACE_BATCHES, step_kind: str = 'train') -> MemoryEstimate:
    """Trace train.py's update for `args` on fake tensors at `batches` (in a child process) and fit each category.

    Args:
        args: train.py's namespace (after `init_device`, or parsed with rank and world size set); not modified. Its
            `gpu`, where it has one (tune_batch.py's and validate.py's `--gpu`), names the card planned for
            (`timm_ext.memory_model.cards.find_card`), and its `software` (`--software`) the torch, CUDA and cuDNN.
        device_type: The device to predict for: 'cpu' or 'cuda' (`timm_ext.memory_model.devices.device_model`).
        onednn: CPU: whether oneDNN will run the convolutions.
        batches: The batch sizes traced (at least two).
        step_kind: One of `STEPS`: 'train' (an update), 'eval' (train.py's evaluation forward, the optimizer state
            resident) or 'validate' (a forward with the weights alone).

    Raises:
        EstimateError: The model or its step cannot run on fake tensors (or the child died).
    """
    device = run_device(args, device_type, onednn)
    problem = compile_problem(args.torchcompile, device.software) if device_type == 'cuda' else None
    if problem:
        raise EstimateError(problem)
    estimate = MemoryEstimate.from_json(_traced(args, device_type, onednn, tuple(batches), step_kind), device)
    if estimate.replay is not None and not estimate.replay.aligned:  # each batch the plan asks is traced on its own
        estimate.replay.retrace = functools.partial(_step_log_at, args, device_type, onednn, step_kind)
    return estimate


def _traced(args: argparse.Namespace, device_type: str, onednn: bool, batches: Tuple[int, ...],
            step_kind: str) -> dict:
    """The trace's JSON from a child of its own.

    Raises:
        EstimateError: The step cannot be traced (or the child died).
    """
    reply = in_child(_traced_reply, args, device_type, onednn, batches, step_kind)
    if reply is None:
        raise EstimateError(f'the estimate of {args.model} died before it finished (its process gave no answer)')
    if 'error' in reply:
        raise EstimateError(reply['error'])
    return reply


def _step_log_at(args: argparse.Namespace, device_type: str, onednn: bool, step_kind: str, batch: int) -> dict:
    """The step's log at `batch`, traced there (with the batch after it: a trace's log is read at two sizes)."""
    return CudaReplay(_traced(args, device_type, onednn, (batch, batch + 1), step_kind)['log']).log_at(batch)
