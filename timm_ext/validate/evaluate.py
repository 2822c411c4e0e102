"""Validate one model on one dataset: build once, evaluate every sample once, stepping down on out-of-memory.

Stock validate.py `--retry` rebuilds the model and loaders and reruns everything at each smaller size. Here the
model is built once and the pass itself is the probe: it starts at the asked size (capped at the dataset's size),
and a batch that runs out of memory, the first or any later one, is retried from the first unfinished sample at the
next smaller size of the `decay_batch_step` grid. A batch that fits is part of the result, so no sample is computed
twice (an iterable dataset, which cannot be sliced, starts over). Only OOMs are retried.
"""
import logging
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
from timm.data import RealLabelsImagenet, create_dataset, create_loader, resolve_data_config
from timm.layers import apply_test_time_pool, set_fast_norm
from timm.models import create_model
from timm.utils import accuracy, random_seed, reparameterize_model, set_jit_fuser

from ..amp import AmpChoice, resolve_amp
from ..batch_decay import decay_batch_step
from ..cuda_backends import CUDA_GRAPH_MODES
from ..distributed import DeviceError, check_cuda_index
from ..errors import TimmExtError
from .batch_estimate import estimate_eval_batch, start_batch
from .hub import is_download_error, pretrained_unavailable
from ..memory import free_memory
from .metrics import precision_recall_f1
from ..oom import is_oom, should_retry
from .weights import WeightsError, checkpoint_num_classes, load_weights, one_line, read_weights

__all__ = ['ValidationError', 'EvalModel', 'EvalTotals', 'resolve_device', 'build_eval_model', 'build_eval_dataset',
           'build_eval_loader', 'evaluate', 'make_eval_step', 'next_smaller_batch', 'EvalPass', 'validate_model']

_logger = logging.getLogger(__name__)


class ValidationError(TimmExtError):
    """A failure the user can act on; the message is one line, reported without a traceback."""


def _release(exc: BaseException, device: torch.device) -> None:
    """Let go of everything a failed batch held: the frames of the traceback, then the freed memory."""
    traceback.clear_frames(exc.__traceback__)
    free_memory(device)


def resolve_device(name: str) -> torch.device:
    """The device to validate on. CUDA asked on a machine without it falls back to the CPU, saying so."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValidationError(f'--device {name!r} is not a device ({one_line(e)}); use e.g. cuda, cuda:1 or cpu') \
            from None
    if device.type == 'cuda' and not torch.cuda.is_available():
        _logger.warning(f'CUDA is not available here: validating on the CPU instead of {name}.')
        return torch.device('cpu')
    if device.type == 'cuda':
        try:
            check_cuda_index(name)
        except DeviceError as e:
            raise ValidationError(str(e)) from None
        if device.index is not None:
            # work that names no index (library handles, 'cuda' tensors) then lands on this device, not on GPU 0
            torch.cuda.set_device(device)
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as e:
        raise ValidationError(f'--device {name} cannot be used ({one_line(e)}); pick an available device') from None
    return device


@dataclass
class EvalModel:
    """A model ready for inference, with everything that decides its memory use and its results row."""
    model: nn.Module
    name: str
    device: torch.device
    data_config: Dict[str, Any]
    amp: AmpChoice
    model_dtype: Optional[torch.dtype]
    channels_last: bool
    param_count: int
    crop_pct: float


def build_eval_model(args, model_name: str, checkpoint: Optional[str], device: torch.device) -> EvalModel:
    """Create, load, transform and place the model as stock validate.py does, with one-line errors.

    Args:
        args: validate.py arguments.
        model_name: timm model name.
        checkpoint: Weights file, or None/'' for the pretrained weights.
        device: Where to run.
    """
    pretrained = args.pretrained or not checkpoint
    weights = None
    if checkpoint:
        try:
            weights = read_weights(checkpoint, args.use_ema)
        except WeightsError as e:
            raise ValidationError(str(e)) from None
    if pretrained:
        reason = pretrained_unavailable(model_name)
        if reason:
            raise ValidationError(f'no pretrained weights for {model_name!r} in the local cache and {reason}; '
                                  f'pass --checkpoint PATH to validate your own weights')

    num_classes = args.num_classes
    if num_classes is None and weights is not None:
        num_classes = checkpoint_num_classes(weights, model_name)  # its head, not the model default
        if num_classes is not None:
            _logger.info(f'Using the {num_classes} classes of {checkpoint} (no --num-classes given).')
    in_chans = args.in_chans if args.in_chans is not None else (args.input_size[0] if args.input_size else 3)
    try:
        model = create_model(model_name, pretrained=pretrained, num_classes=num_classes, in_chans=in_chans,
                             global_pool=args.gp, scriptable=args.torchscript, **args.model_kwargs)
    except Exception as e:
        if 'Unknown model' in str(e):
            raise ValidationError(f'unknown model {model_name!r}; see timm.list_models()') from None
        if pretrained and is_download_error(e):
            raise ValidationError(f'could not download pretrained weights for {model_name!r} ({one_line(e)}); '
                                  f'pass --checkpoint PATH to validate your own weights') from None
        raise
    if weights is not None:
        try:
            load_weights(model, weights, checkpoint, model_name)
        except WeightsError as e:
            raise ValidationError(str(e)) from None
        del weights
    if args.reparam:
        model = reparameterize_model(model)
    param_count = sum(p.numel() for p in model.parameters())
    _logger.info(f'Model {model_name} created, param count: {param_count}')

    data_config = resolve_data_config(vars(args), model=model, use_test_size=not args.use_train_size, verbose=True)
    test_time_pool = False
    if args.test_pool:
        model, test_time_pool = apply_test_time_pool(model, data_config)

    model_dtype = getattr(torch, args.model_dtype) if args.model_dtype else None
    amp = resolve_amp(device, args.amp, args.amp_dtype)
    _logger.info(amp.message if amp.enabled else f'Validating in {model_dtype or torch.float32}. AMP not enabled.')
    model = model.to(device=device, dtype=model_dtype)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.torchscript:
        model = torch.jit.script(model)
    elif args.torchcompile:
        torch._dynamo.reset()
        model = torch.compile(model, backend=args.torchcompile, mode=args.torchcompile_mode)
    elif args.aot_autograd:
        try:
            from functorch.compile import memory_efficient_fusion
        except ImportError:
            raise ValidationError('--aot-autograd needs functorch, which this torch build lacks') from None
        model = memory_efficient_fusion(model)
    if args.num_gpu > 1:
        if device.type != 'cuda':
            _logger.warning(f'--num-gpu {args.num_gpu} ignored: DataParallel needs CUDA devices.')
        else:
            model = nn.DataParallel(model, device_ids=list(range(args.num_gpu)))
    model.eval()
    return EvalModel(model, model_name, device, data_config, amp, model_dtype, args.channels_last, param_count,
                     1.0 if test_time_pool else data_config['crop_pct'])


def build_eval_dataset(args, em: EvalModel):
    """The evaluation split, with failures (no images, unreadable folder) as one-line errors."""
    root = args.data or args.data_dir
    img_mode = args.input_img_mode or ('RGB' if em.data_config['input_size'][0] == 3 else 'L')
    try:
        return create_dataset(
            root=root, name=args.dataset, split=args.split, download=args.dataset_download,
            load_bytes=args.tf_preprocessing, class_map=args.class_map, num_samples=args.num_samples,
            input_key=args.input_key, input_img_mode=img_mode, target_key=args.target_key,
            trust_remote_code=args.dataset_trust_remote_code, seed=args.seed)
    except (RuntimeError, OSError, ValueError, AssertionError) as e:
        raise ValidationError(f'cannot load the {args.split!r} split of dataset {args.dataset or root!r}: '
                              f'{one_line(e)}') from None


def build_eval_loader(args, dataset, em: EvalModel, batch_size: int):
    """The stock evaluation loader (or the NaFlex one) at `batch_size`."""
    dc = em.data_config
    common = dict(batch_size=batch_size, use_prefetcher=not args.no_prefetcher, interpolation=dc['interpolation'],
                  mean=dc['mean'], std=dc['std'], num_workers=args.workers, crop_pct=em.crop_pct,
                  crop_mode=dc['crop_mode'], crop_border_pixels=args.crop_border_pixels, pin_memory=args.pin_mem,
                  device=em.device, img_dtype=em.model_dtype or torch.float32)
    if args.naflex_loader:
        from timm.data import create_naflex_loader
        embeds = getattr(em.model, 'embeds', None)
        return create_naflex_loader(dataset, patch_size=getattr(embeds, 'patch_size', None) or (16, 16),
                                    max_seq_len=args.naflex_max_seq_len, **common)
    return create_loader(dataset, input_size=dc['input_size'], tf_preprocessing=args.tf_preprocessing, **common)


@dataclass
class EvalTotals:
    """Running sums of an evaluation pass, kept on the device so batches need no host sync until logged."""
    samples: int = 0
    batches: int = 0
    sums: Optional[torch.Tensor] = None  # sample-weighted loss, top-1 and top-5
    preds: List[torch.Tensor] = field(default_factory=list)
    targets: List[torch.Tensor] = field(default_factory=list)

    def add(self, n: int, loss: torch.Tensor, acc1: torch.Tensor, acc5: torch.Tensor) -> None:
        batch = torch.stack([loss.float(), acc1.float(), acc5.float()]) * n
        self.sums = batch if self.sums is None else self.sums + batch
        self.samples += n
        self.batches += 1

    def averages(self) -> Dict[str, float]:
        if not self.samples:
            return {'loss': float('nan'), 'top1': 0.0, 'top5': 0.0}
        loss, top1, top5 = (self.sums / self.samples).tolist()
        return {'loss': loss, 'top1': top1, 'top5': top5}


def evaluate(em: EvalModel, loader, totals: EvalTotals, *, valid_labels: Optional[Sequence[int]] = None,
             real_labels: Optional[RealLabelsImagenet] = None, keep_predictions: bool = False,
             log_freq: int = 10, total_batches: Optional[int] = None) -> EvalTotals:
    """Run `loader` through the model, adding each finished batch to `totals` (so an interrupted pass can continue).

    A batch is counted only once all its work succeeded: an OOM in the middle of one leaves `totals` (and
    `real_labels`) at the last finished batch.
    """
    criterion = nn.CrossEntropyLoss().to(em.device)
    label_index = torch.tensor(valid_labels, device=em.device) if valid_labels is not None else None
    logged_samples, logged_time = totals.samples, time.perf_counter()
    with torch.inference_mode():
        for input, target in loader:
            if isinstance(input, torch.Tensor):
                input = input.to(device=em.device, dtype=em.model_dtype)
                if em.channels_last:
                    input = input.contiguous(memory_format=torch.channels_last)
            target = target.to(device=em.device)
            with em.amp.autocast():
                output = em.model(input)
                if label_index is not None:
                    output = output.index_select(1, label_index)
                loss = criterion(output, target)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            predictions = output.argmax(dim=1).cpu() if keep_predictions else None
            if real_labels is not None:
                real_labels.add_result(output)
            totals.add(output.shape[0], loss, acc1, acc5)
            if predictions is not None:
                totals.preds.append(predictions)
                totals.targets.append(target.cpu())
            if (totals.batches - 1) % log_freq == 0:
                avg = totals.averages()  # syncs the device (otherwise only metrics or ReaL labels do)
                now = time.perf_counter()
                rate = (totals.samples - logged_samples) / max(now - logged_time, 1e-9)
                logged_samples, logged_time = totals.samples, now
                of = f'/{total_batches}' if total_batches else ''
                _logger.info(f'Test: [{totals.batches - 1:>4d}{of}]  {totals.samples} samples  {rate:>7.2f}/s  '
                             f'Loss: {loss.item():>7.4f} ({avg["loss"]:>6.4f})  Acc@1: {avg["top1"]:>7.3f}  '
                             f'Acc@5: {avg["top5"]:>7.3f}')
    return totals


def make_eval_step(em: EvalModel, prefetch_copies: int = 1) -> Callable[[int], None]:
    """Return `step(batch_size)`: one inference forward at the run's input size, dtype, AMP and layout.

    The input is made on the device (no data loading). With the prefetcher, the loader holds the next batch while
    the model runs on the current one, so `prefetch_copies` extra input batches are kept alive during the step.
    Failures (OOM or not) propagate; `timm_ext.probe.measure.measured_trial` turns them into trial records.
    """
    input_size = tuple(em.data_config['input_size'])

    def step(batch_size: int) -> None:
        shape = (batch_size,) + input_size
        held = [torch.zeros(shape, device=em.device, dtype=em.model_dtype) for _ in range(prefetch_copies)]
        x = torch.zeros(shape, device=em.device, dtype=em.model_dtype)
        if em.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.inference_mode(), em.amp.autocast():
            em.model(x)
        del x, held

    return step


def next_smaller_batch(batch_size: int, unfinished: Optional[int]) -> int:
    """The size to continue at after a batch of `batch_size` ran out of memory with `unfinished` samples left: the
    next smaller size of the decay grid, below the failed batch itself (a short last batch has fewer samples than
    the batch size); 0 when the failed batch held one sample."""
    failed = batch_size if unfinished is None else min(batch_size, unfinished)
    return decay_batch_step(failed)


def _num_samples(dataset) -> Optional[int]:
    try:
        return len(dataset)
    except TypeError:
        return None


def _remaining(dataset, done: int):
    """The part of a map-style dataset not evaluated yet, or None when it cannot be sliced (iterable datasets)."""
    if done == 0:
        return dataset
    if isinstance(dataset, torch.utils.data.IterableDataset) or _num_samples(dataset) is None:
        return None
    return torch.utils.data.Subset(dataset, range(done, len(dataset)))


@dataclass
class EvalPass:
    """What a pass over the split needs besides the model: label restrictions and ReaL labels."""
    dataset: Any
    valid_labels: Optional[List[int]] = None
    real_labels_json: str = ''
    keep_predictions: bool = False
    log_freq: int = 10

    def new_real_labels(self) -> Optional[RealLabelsImagenet]:
        if not self.real_labels_json:
            return None
        return RealLabelsImagenet(self.dataset.filenames(basename=True), real_json=self.real_labels_json)


def _oom_error(batch_size: int, exc: BaseException) -> ValidationError:
    return ValidationError(f'out of memory at batch size {batch_size} ({one_line(exc)}); pass --retry or a smaller -b')


def _evaluate_stepping_down(args, em: EvalModel, run: EvalPass, batch_size: int, step_down: bool):
    """Evaluate the whole split at `batch_size`; with `step_down`, an OOM continues at the next grid size from the
    first unfinished sample (an iterable dataset, which cannot be sliced, starts over). The batches that fitted stay
    counted, so each sample is computed once however many sizes the pass tries.

    Returns:
        (totals, real labels or None, the batch sizes run in order).
    """
    totals, real_labels, ran = EvalTotals(), run.new_real_labels(), []
    while True:
        part = _remaining(run.dataset, totals.samples)
        if part is None:
            totals, real_labels, part = EvalTotals(), run.new_real_labels(), run.dataset
        loader = build_eval_loader(args, part, em, batch_size)
        ran.append(batch_size)
        try:
            evaluate(em, loader, totals, valid_labels=run.valid_labels, real_labels=real_labels,
                     keep_predictions=run.keep_predictions, log_freq=run.log_freq,
                     total_batches=_num_samples(loader) if totals.samples == 0 else None)
            return totals, real_labels, ran
        except Exception as e:
            if not (step_down and should_retry(e)):
                if is_oom(e):
                    raise _oom_error(batch_size, e) from None
                raise
            total = _num_samples(run.dataset)
            smaller = next_smaller_batch(batch_size, None if total is None else total - totals.samples)
            _logger.warning(f'Batch size {batch_size} ran out of memory after {totals.samples} samples '
                            f'({one_line(e)}); continuing at {smaller}.')
            if em.device.type == 'cuda' and args.torchcompile and args.torchcompile_mode in CUDA_GRAPH_MODES:
                torch._dynamo.reset()  # the failed size's graphs keep their tree's pool past empty_cache
            _release(e, em.device)
            del loader
            if not smaller:
                raise ValidationError(f'{em.name} runs out of memory even at batch size 1 ({one_line(e)})') from None
            batch_size = smaller


def _predicted_batch(args, model_name: str, device: torch.device) -> Optional[int]:
    """The largest batch the memory estimate predicts for this forward: on CUDA, or within an asked --mem-budget
    (None where nothing could OOM or the forward cannot be traced; the pass then starts at the asked size). No headroom:
    the pass steps down on an out-of-memory error (`batch_estimate.STEPPING_DOWN`)."""
    if device.type != 'cuda' and not args.mem_budget:
        return None
    try:
        return estimate_eval_batch(args, model_name, device.type, args.mem_budget, steps_down=True).batch_size
    except TimmExtError as e:
        _logger.info(f'No memory estimate for {model_name} ({e}); the pass starts at the asked batch size.')
        return None


def _results_row(em: EvalModel, totals: EvalTotals, real_labels, metrics_avg: Optional[str]) -> 'OrderedDict':
    """The stock results row (precision/recall/F1 between top5_err and param_count when asked)."""
    avg = totals.averages()
    top1, top5 = avg['top1'], avg['top5']
    if real_labels is not None:  # ReaL labels replace the top-k accuracies
        top1, top5 = real_labels.get_accuracy(k=1), real_labels.get_accuracy(k=5)
    extra = {}
    if metrics_avg:
        scores = precision_recall_f1(torch.cat(totals.preds), torch.cat(totals.targets), metrics_avg)
        extra = {f'{metrics_avg}_{name}': round(100 * scores[key], 4)
                 for name, key in (('precision', 'precision'), ('recall', 'recall'), ('f1_score', 'f1'))}
    return OrderedDict(
        model=em.name, top1=round(top1, 4), top1_err=round(100 - top1, 4), top5=round(top5, 4),
        top5_err=round(100 - top5, 4), **extra, param_count=round(em.param_count / 1e6, 2),
        img_size=em.data_config['input_size'][-1], crop_pct=em.crop_pct,
        interpolation=em.data_config['interpolation'])


def validate_model(args, model_name: str, checkpoint: Optional[str], device: torch.device,
                   probe_first: bool) -> 'OrderedDict[str, Any]':
    """Validate one model and return its stock results row.

    Args:
        args: validate.py arguments (not modified).
        model_name: timm model name.
        checkpoint: Weights file, or None/'' for pretrained weights.
        device: Device to run on.
        probe_first: Start at the asked size and step down the grid on an OOM, continuing from the first
            unfinished sample (`--retry`, and bulk mode); the row then records the `batch_size` it ended at. Without
            it an OOM is an error, as stock (after stock's warm-up forward at the batch size).

    Raises:
        ValidationError: A one-line, user-fixable failure (bad weights, no data, out of memory at size 1, ...).
    """
    random_seed(args.seed)
    if args.fuser:
        set_jit_fuser(args.fuser)
    if args.fast_norm:
        set_fast_norm()
    # before the model is built: the trace runs in a forked child
    predicted = _predicted_batch(args, model_name, device) if probe_first and not args.naflex_loader else None
    em = build_eval_model(args, model_name, checkpoint, device)
    dataset = build_eval_dataset(args, em)
    num_samples = _num_samples(dataset)
    if num_samples == 0:
        raise ValidationError(f'the {args.split!r} split of {args.data or args.data_dir} holds no samples')
    valid_labels = None
    if args.valid_labels:
        with open(args.valid_labels) as f:
            valid_labels = [int(line.strip()) for line in f if line.strip()]
    run = EvalPass(dataset, valid_labels, args.real_labels, bool(args.metrics_avg), args.log_freq)

    # stock --retry scales the per-GPU size by --num-gpu (DataParallel splits each batch)
    asked = args.batch_size * (args.num_gpu if probe_first and em.device.type == 'cuda' else 1)
    largest = min(asked, num_samples or asked)  # no batch of the pass is larger than the split
    if args.naflex_loader:
        batch_size = asked  # NaFlex batches are token budgets, not image tensors; the pass steps down the same way
    elif probe_first:
        batch_size = largest  # the pass is the probe: its first batches find the size, and they count
        if predicted is not None and start_batch(largest, predicted) < largest:
            batch_size = start_batch(largest, predicted)
            _logger.info(f'Batch size {largest} is predicted not to fit (the memory estimate: {predicted}); the pass '
                         f'starts at {batch_size}.')
    else:
        batch_size = asked
        try:  # stock warm-up: one forward at the largest batch the pass will see
            make_eval_step(em, prefetch_copies=0)(largest)
        except Exception as e:
            if is_oom(e):
                raise _oom_error(largest, e) from None
            raise

    totals, real_labels, ran = _evaluate_stepping_down(args, em, run, batch_size, step_down=probe_first)
    if len(ran) > 1:
        _logger.info(f'Batch sizes run: {" -> ".join(map(str, ran))}.')
    if probe_first:
        failed = ''.join(f'{size} OOM, ' for size in ran[:-1]) or 'no OOM, '
        _logger.info(f'Batch-size probe: {failed}validated at {ran[-1]}; every sample computed once.')
    results = _results_row(em, totals, real_labels, args.metrics_avg)
    if probe_first:
        results['batch_size'] = ran[-1]
    metrics = ''.join(f' | {k} {v:.3f}' for k, v in results.items() if k.startswith(f'{args.metrics_avg}_'))
    _logger.info(f' * Acc@1 {results["top1"]:.3f} ({results["top1_err"]:.3f}) Acc@5 {results["top5"]:.3f} '
                 f'({results["top5_err"]:.3f}){metrics}')
    return results
