"""Memory savers priced before anything runs: each one's micro-batch, plan for the recipe's batch and extra compute.

When the recipe's micro-batch does not fit, the user has choices besides accumulation: mixed precision, gradient
checkpointing, channels_last, the EMA on the host, an optimizer with less state, expandable allocator segments, a
smaller input. `price_savers` prices each saver the run does not use yet and plans it as the run's own plan is made
(the caller's `plan_for`). A saver that changes only where or how the step's bytes live is read off the run's own
trace by a stated rule (`timm_ext.tune.saver_rules`: channels-last, SGD, the EMA on the host; expandable segments
replay the run's own CUDA trace on an allocator that has them); the others are traced on fake tensors
(`timm_ext.memory_model.estimate`), side by side where cores are free, one trace for both AMP dtypes. The extra compute
is the traced step's FLOPs per sample against the run's (`torch.utils.flop_counter`: checkpointing's recomputed
forwards). `savers_table` is a fact sheet: it names the row that gives the recipe's batch in one step at the least
extra compute and leaves the choice to the user; `--apply-saver NAME` (`apply_savers`) puts a saver's stock flags into
the run. tune_batch.py shows it where the plan accumulates, where nothing fits, and with `--savers`.
"""
import argparse
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import timm
from timm.models import PretrainedCfg

from ..errors import TimmExtError, UsageError, one_line
from ..memory_model.allocator_config import expandable_setting
from ..memory_model.estimate import MemoryEstimate
from ..memory_model.predict import CudaReplay
from ..memory_model.trace_pool import estimate_each
from ..memory_model.versions import run_software
from ..train.setup import with_values
from .plan import RunPlan
from .saver_rules import RuleError, host_ema, momentum_sgd, same_layout_bytes

__all__ = ['SAVER_NAMES', 'EXPANDABLE_CONF', 'PlanFor', 'Saver', 'PricedSaver', 'candidate_savers', 'apply_savers',
           'price_savers', 'saver_trace_calls', 'savers_table', 'cheapest', 'nothing_fits_advice']

SAVER_NAMES = ('amp-float16', 'amp-bfloat16', 'grad-checkpointing', 'channels-last', 'model-ema-force-cpu', 'opt-sgd',
               'expandable-segments', 'smaller-img-size')
EXPANDABLE_CONF = 'expandable_segments:True'
CONFLICTING = (('amp-float16', 'amp-bfloat16'),)  # savers that set the same flag to different values
SAME = 'same'
SMALLER_SIDE = 0.75  # the smaller input's side, of the run's, down to a multiple of `SIDE_STEP`
SIDE_STEP = 32
# an optimizer holding more than this many bytes of state per byte of gradient is offered SGD (one momentum buffer)
STATE_PER_GRADIENT = 1.5

AMP_SAVERS = ('amp-float16', 'amp-bfloat16')
# the savers a rule prices from the run's own trace (timm_ext.tune.saver_rules)
PRICED_BY_RULE = {'channels-last': same_layout_bytes, 'opt-sgd': momentum_sgd, 'model-ema-force-cpu': host_ema}

PlanFor = Callable[[MemoryEstimate], Tuple[int, Optional[RunPlan]]]


@dataclass(frozen=True)
class Saver:
    """One way to need less memory.

    Attributes:
        name: Its `--apply-saver` name.
        flags: How a run asks for it (flags, or an environment setting).
        values: The train.py dests it sets (stock keys; empty for an environment setting).
        math: 'same' when the update computes what it did, else what changes.
        environment: The environment variable and value it needs instead of flags ('' for none).
    """
    name: str
    flags: str
    values: Dict[str, Any] = field(default_factory=dict)
    math: str = SAME
    environment: Tuple[str, str] = ('', '')


@dataclass(frozen=True)
class PricedSaver:
    """A saver's price by the estimate.

    Attributes:
        saver: The saver.
        micro_batch: The largest micro-batch it reaches (0: not even 1).
        plan: The plan for the recipe's global batch (None when nothing fits).
        extra_compute: FLOPs per sample beyond the run's, as a fraction (negative: fewer).
        problem: Why it could not be priced ('' when it was): the model does not support it, say.
    """
    saver: Saver
    micro_batch: int = 0
    plan: Optional[RunPlan] = None
    extra_compute: float = 0.0
    problem: str = ''

    @property
    def one_step(self) -> bool:
        """Whether it runs the recipe's global batch exactly with no accumulation."""
        return self.plan is not None and self.plan.accum_steps == 1 and self.plan.exact is not False


def _model_cfg(name: str) -> PretrainedCfg:
    """The pretrained config timm builds the model `name` with: the name's own; a deprecated name's current one
    (`timm.models.get_deprecated_models`: xception is legacy_xception.tf_in1k); else timm's defaults, which
    `timm.models._builder.resolve_pretrained_cfg` falls back to when none is registered (`PretrainedCfg()`). A name
    timm refuses (an unknown tag) gets the defaults here: building the run refuses it in one line."""
    try:
        cfg = timm.models.get_pretrained_cfg(name)
        current = timm.models.get_deprecated_models().get(name)
        if cfg is None and current:
            cfg = timm.models.get_pretrained_cfg(current)
    except RuntimeError:  # an invalid pretrained tag
        cfg = None
    return cfg or PretrainedCfg()


def _input_side(args: argparse.Namespace) -> int:
    """The side of the run's training input: --input-size, --img-size, else the model's default."""
    if args.input_size:
        return args.input_size[-1]
    return args.img_size or _model_cfg(args.model).input_size[-1]


def _smaller_input(args: argparse.Namespace) -> Optional[Saver]:
    """A smaller --img-size (the model told its size where its input size is fixed), or None when none is smaller."""
    side = max(SIDE_STEP, int(_input_side(args) * SMALLER_SIDE) // SIDE_STEP * SIDE_STEP)
    if side >= _input_side(args):
        return None
    values: Dict[str, Any] = dict(img_size=side)
    flags = f'--img-size {side}'
    if args.input_size:
        values['input_size'] = [args.input_size[0], side, side]
        flags = f'--input-size {args.input_size[0]} {side} {side}'
    if _model_cfg(args.model).fixed_input_size:  # a ViT's patch grid is built for one size
        values['model_kwargs'] = {**args.model_kwargs, 'img_size': side}
        flags += f' --model-kwargs img_size={side}'
    return Saver('smaller-img-size', flags, values, f'changes: trains at {side} px')


def _expandable_environment(args: argparse.Namespace) -> Tuple[str, str]:
    """The allocator setting with expandable segments, in the variable the run's torch reads, the user's other options
    kept (`expandable_setting`; only `expandable_segments:True` where the user's setting is refused, which planning
    reports)."""
    try:
        return expandable_setting(software=run_software(getattr(args, 'software', None))[0])
    except UsageError:
        return 'PYTORCH_ALLOC_CONF', EXPANDABLE_CONF


def _all_savers(args: argparse.Namespace) -> Dict[str, Optional[Saver]]:
    """Every saver by name, as it would apply to this run (None: it has no form here)."""
    expandable = _expandable_environment(args)
    return {
        'amp-float16': Saver('amp-float16', '--amp --amp-dtype float16', dict(amp=True, amp_dtype='float16'),
                             'rounding: float16 autocast, loss scaling'),
        'amp-bfloat16': Saver('amp-bfloat16', '--amp --amp-dtype bfloat16', dict(amp=True, amp_dtype='bfloat16'),
                              'rounding: bfloat16 autocast'),
        'grad-checkpointing': Saver('grad-checkpointing', '--grad-checkpointing', dict(grad_checkpointing=True)),
        'channels-last': Saver('channels-last', '--channels-last', dict(channels_last=True)),
        'model-ema-force-cpu': Saver('model-ema-force-cpu', '--model-ema-force-cpu', dict(model_ema_force_cpu=True)),
        'opt-sgd': Saver('opt-sgd', '--opt sgd', dict(opt='sgd'),
                         f'changes: SGD with momentum instead of {args.opt} (retune LR and schedule)'),
        'expandable-segments': Saver('expandable-segments', '='.join(expandable), environment=expandable),
        'smaller-img-size': _smaller_input(args),
    }


def candidate_savers(args: argparse.Namespace, device_type: str, base: Optional[MemoryEstimate]) -> List[Saver]:
    """The savers the run does not use yet and that its device and model offer, in `SAVER_NAMES` order (with no
    `base` yet, those its arguments offer: SGD and expandable segments, which read the run's trace, left out)."""
    full_precision = not args.model_dtype or args.model_dtype == 'float32'
    offered = {
        'amp-float16': full_precision and not (args.amp and args.amp_dtype == 'float16'),
        'amp-bfloat16': full_precision and not (args.amp and args.amp_dtype == 'bfloat16'),
        'grad-checkpointing': not args.grad_checkpointing,
        'channels-last': not args.channels_last,
        'model-ema-force-cpu': device_type == 'cuda' and args.model_ema and not args.model_ema_force_cpu,
        'opt-sgd': base is not None and base.lines['optimizer'][0] > STATE_PER_GRADIENT * base.grad_bytes,
        'expandable-segments': (base is not None and base.replay is not None
                                and not base.replay.config.allocator.expandable_segments),
        'smaller-img-size': True,
    }
    savers = _all_savers(args)
    return [savers[name] for name in SAVER_NAMES if offered[name] and savers[name] is not None]


SaverNames = Union[str, Sequence[str], None]  # --apply-saver's value: names, or one name from a -c YAML


def apply_savers(args: argparse.Namespace, names: SaverNames) -> Tuple[argparse.Namespace, List[str]]:
    """`args` with the named savers' flags on, and a line for each environment setting, which a config cannot hold
    (it is set in this process too, for what runs and plans here): expandable segments are merged into the allocator
    setting torch reads (`timm_ext.memory_model.allocator_config.expandable_setting`), the user's options kept.

    Raises:
        TimmExtError: A saver that has no form for this run (no smaller input than the run's).
        UsageError: Savers that conflict; expandable segments off CUDA; an allocator setting torch refuses.
    """
    chosen = [names] if isinstance(names, str) else list(names or ())
    for first, second in CONFLICTING:
        if first in chosen and second in chosen:
            raise UsageError(f'--apply-saver {first} and --apply-saver {second} set --amp-dtype to different values; '
                             f'keep one')
    savers, notes = _all_savers(args), []
    for name in chosen:
        saver = savers[name]
        if saver is None:
            raise TimmExtError(f'--apply-saver {name}: the run\'s input is already the smallest it offers; drop it')
        if saver.environment[0] and not args.device.startswith('cuda'):
            raise UsageError(f'--apply-saver {name}: expandable segments are an option of the CUDA caching allocator, '
                             f'which --device {args.device} does not use; drop it')
        args = with_values(args, **saver.values)
        if saver.environment[0]:
            variable, value = expandable_setting(software=run_software(getattr(args, 'software', None))[0])
            os.environ[variable] = value
            notes.append(f'--apply-saver {name}: set {variable}={value} in train.py\'s environment (not a config '
                         f'key; set here for this process).')
    return args, notes


def price_savers(args: argparse.Namespace, device_type: str, onednn: bool, base: MemoryEstimate,
                 plan_for: PlanFor, traced: Optional[Dict[str, Union[MemoryEstimate, TimmExtError]]] = None
                 ) -> List[PricedSaver]:
    """Each candidate saver (`candidate_savers`) priced and planned by `plan_for`, the run's own planning: from the
    run's own trace where a rule prices it (`timm_ext.tune.saver_rules`), else traced (side by side,
    `timm_ext.memory_model.trace_pool.estimate_each`).

    Args:
        args: The run's arguments, as `estimate_memory` takes them.
        device_type: 'cpu' or 'cuda'.
        onednn: CPU: whether oneDNN runs the convolutions.
        base: The run's own estimate (its FLOPs are the reference; its trace prices the rules' savers).
        plan_for: The micro-batch and plan an estimate gives under the run's budget.
        traced: What `saver_trace_calls` asked for, traced already (beside the run's own trace), by saver name.
    """
    savers = candidate_savers(args, device_type, base)
    estimates = _saver_estimates(args, device_type, onednn, base, savers, traced or {})
    rows = []
    for saver in savers:
        estimate = estimates[saver.name]
        if isinstance(estimate, TimmExtError):  # the model does not support it, or the step cannot be traced with it
            rows.append(PricedSaver(saver, problem=one_line(estimate)[:120]))
            continue
        micro, plan = plan_for(estimate)
        extra = estimate.flops_per_sample / base.flops_per_sample - 1 if base.flops_per_sample else 0.0
        rows.append(PricedSaver(saver, micro, plan, extra))
    return rows


def saver_trace_calls(args: argparse.Namespace, device_type: str, onednn: bool,
                      savers: Optional[Sequence[Saver]] = None) -> Dict[str, dict]:
    """`estimate_memory`'s arguments for each saver that needs a trace of its own, by name (of `savers`, else of
    those the run's arguments offer): one AMP trace for both dtypes, none where the run autocasts already (2-byte
    autocast either way: the run's own bytes), gradient checkpointing, a smaller input."""
    calls = {}
    for saver in candidate_savers(args, device_type, None) if savers is None else savers:
        if saver.environment[0] or saver.name in PRICED_BY_RULE:
            continue
        if saver.name in AMP_SAVERS and (args.amp or any(name in AMP_SAVERS for name in calls)):
            continue
        calls[saver.name] = dict(args=with_values(args, **saver.values), device_type=device_type, onednn=onednn)
    return calls


def _saver_estimates(args: argparse.Namespace, device_type: str, onednn: bool, base: MemoryEstimate,
                     savers: Sequence[Saver], traced: Dict[str, Union[MemoryEstimate, TimmExtError]]
                     ) -> Dict[str, Union[MemoryEstimate, TimmExtError]]:
    """Each saver's estimate (or why it has none): its own trace (`saver_trace_calls`; those not in `traced` traced
    here, side by side), a rule's on the run's trace, the AMP trace (or the run's) for both AMP dtypes."""
    calls = saver_trace_calls(args, device_type, onednn, savers)
    missing = [name for name in calls if name not in traced]
    found = {**{name: traced[name] for name in calls if name in traced},
             **dict(zip(missing, estimate_each([calls[name] for name in missing])))}
    amp = next((found[name] for name in AMP_SAVERS if name in calls), base)
    for saver in savers:
        if saver.name in found:
            continue
        if saver.environment[0]:  # the same step on an allocator with expandable segments: no new trace
            found[saver.name] = _on_expandable_segments(base)
        elif saver.name in PRICED_BY_RULE:
            try:
                found[saver.name] = PRICED_BY_RULE[saver.name](base)
            except RuleError:  # the trace lacks what the rule reads: trace the saver instead
                found[saver.name] = estimate_each([dict(args=with_values(args, **saver.values),
                                                        device_type=device_type, onednn=onednn)])[0]
        else:  # the other AMP dtype: the AMP trace's bytes, or the run's own where it autocasts already
            found[saver.name] = amp
    return found


def _on_expandable_segments(base: MemoryEstimate) -> MemoryEstimate:
    """The run's own step replayed on an allocator with expandable segments (its other options kept)."""
    config = base.replay.config
    config = replace(config, allocator=replace(config.allocator, expandable_segments=True))
    return replace(base, replay=CudaReplay(base.replay.log, config, retrace=base.replay.retrace))


def cheapest(rows: Sequence[PricedSaver], one_step: bool) -> Optional[PricedSaver]:
    """The row at the least extra compute among those that keep the training (else among all) and fit: the recipe's
    batch in one step (`one_step`), else a micro-batch of 1 or more."""
    fitting = [r for r in rows if (r.one_step if one_step else r.micro_batch >= 1)]
    keeping = [r for r in fitting if not r.saver.math.startswith('changes')]
    return min(keeping or fitting, key=lambda r: r.extra_compute, default=None)


def _split(plan: Optional[RunPlan]) -> str:
    if plan is None:
        return 'nothing fits'
    ranks = f' x {plan.world_size}' if plan.world_size > 1 else ''
    text = f'{plan.micro_batch}{ranks} x {plan.accum_steps}'
    return text if plan.exact is not False else f'{text} = {plan.global_batch}'


def savers_table(rows: Sequence[PricedSaver], as_is: Tuple[int, Optional[RunPlan]], recipe_global: int) -> List[str]:
    """The fact sheet: the run as it is, then a row per saver (micro-batch, plan for the recipe's batch, extra compute,
    training math), and which row gives the recipe's batch in one step at the least extra compute."""
    lines = ['', 'Memory savers the run does not use yet, priced by the estimate '
                 '(--apply-saver NAME writes one into the config):',
             f'  {"saver":<20s} {"flags":<48s} {"micro-batch":>11s} {f"plan for {recipe_global}":>15s} '
             f'{"extra compute":>13s}  training math',
             f'  {"(as is)":<20s} {"-":<48s} {as_is[0]:>11d} {_split(as_is[1]):>15s} {"+0%":>13s}  -']
    for row in rows:
        if row.problem:
            lines.append(f'  {row.saver.name:<20s} {row.saver.flags:<48s} not priced: {row.problem}')
            continue
        lines.append(f'  {row.saver.name:<20s} {row.saver.flags:<48s} {row.micro_batch:>11d} {_split(row.plan):>15s} '
                     f'{row.extra_compute:>+13.0%}  {row.saver.math}')
    best = cheapest(rows, one_step=True)
    if best is None:
        lines.append(f'No saver alone gives the recipe\'s batch {recipe_global} in one step.')
    else:
        lines.append(f'The recipe\'s batch {recipe_global} in one step at the least extra compute: {best.saver.name} '
                     f'({best.extra_compute:+.0%}, training math: {best.saver.math}). The choice is yours.')
    return lines


def nothing_fits_advice(rows: Sequence[PricedSaver]) -> Tuple[str, Tuple[str, ...]]:
    """When nothing fits as the run is: the cheapest saver that fits a batch of 1 or more (or that none does), and
    what each saver reaches, one line a saver."""
    details = []
    for row in rows:
        reach = (f'not priced ({row.problem})' if row.problem else
                 f'micro-batch {row.micro_batch}, plan {_split(row.plan)}' if row.micro_batch else 'nothing fits')
        extra = '' if row.problem else f', {row.extra_compute:+.0%} compute, training math: {row.saver.math}'
        details.append(f'{row.saver.flags}: {reach}{extra}')
    best = cheapest(rows, one_step=False)
    summary = (f'the cheapest saver that fits is {best.saver.flags} (micro-batch {best.micro_batch}; '
               f'--apply-saver {best.saver.name}); each saver below' if best else
               'no saver alone fits a batch of 1 (each below): combine them, or give a larger --mem-budget')
    return summary, tuple(details)
