"""Elastic resume: a run resumed on another world size or device keeps the global batch it trained with.

A checkpoint records how its global batch was built (micro-batch x ranks x accumulation, `timm_ext.train.checkpoint`
reads it back as a `BatchLayout`) and the device it ran on. Resumed on a different number of ranks, stock timm keeps
the micro-batch and accumulation, so the global batch, and with it the optimisation, silently changes. Here the
accumulation is planned again for the checkpoint's global batch (`timm_ext.accum.plan_accumulation`), with the
checkpoint's micro-batch as the largest one known to fit; the LR stays the checkpoint's because the global batch
did not change. A micro-batch or accumulation the user sets anew for the resumed run wins over the re-plan.

The position inside an interrupted epoch is kept in samples: `updates_done` updates of the saved global batch are
that many samples, which the new layout reaches after `resume_updates` of its own updates.

Pure functions: nothing here touches a process group, a device or the arguments.
"""
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from ..accum import plan_accumulation
from ..launch import Topology
from ..lr import rescale_lr

__all__ = ['LAYOUT_FLAGS', 'BatchLayout', 'ElasticResume', 'plan_elastic_resume', 'resume_updates', 'elastic_lr',
           'tune_hint', 'describe_change', 'device_note', 'layout_flags_set_anew']

# train.py dests that make up the layout, and their flags (for messages)
LAYOUT_FLAGS = {'batch_size': '-b/--batch-size', 'grad_accum_steps': '--grad-accum-steps'}


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch is built on the ranks of a run.

    Attributes:
        micro_batch: Samples per forward/backward on each rank (-b/--batch-size).
        world_size: Number of ranks.
        accum_steps: Micro-batches accumulated per update (--grad-accum-steps).
        device_name: The hardware it ran on (`timm_ext.memory.device_name`), '' when unknown.
    """
    micro_batch: int
    world_size: int
    accum_steps: int
    device_name: str = ''

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world_size * self.accum_steps

    def describe(self) -> str:
        ranks = 'rank' if self.world_size == 1 else 'ranks'
        return (f'{self.micro_batch} x {self.world_size} {ranks} x {self.accum_steps} accum = global batch '
                f'{self.global_batch}')


@dataclass(frozen=True)
class ElasticResume:
    """The layout a resumed run trains with, against the checkpoint's.

    Attributes:
        saved: The checkpoint's layout.
        now: The resumed run's layout.
        user_flags: Flags the user set to new values for the resumed run (their layout was kept as given).
        exact: Whether `now` keeps the saved global batch.
        reason: One sentence on how `now` was reached.
    """
    saved: BatchLayout
    now: BatchLayout
    user_flags: Tuple[str, ...]
    exact: bool
    reason: str

    @property
    def layout_changed(self) -> bool:
        return (self.saved.micro_batch, self.saved.world_size, self.saved.accum_steps) != (
            self.now.micro_batch, self.now.world_size, self.now.accum_steps)

    @property
    def device_changed(self) -> bool:
        return bool(self.saved.device_name) and self.saved.device_name != self.now.device_name

    @property
    def global_changed(self) -> bool:
        return self.saved.global_batch != self.now.global_batch


def plan_elastic_resume(saved: BatchLayout, world_size: int, device_name: str, micro_batch: int, accum_steps: int,
                        user_flags: Sequence[str] = ()) -> ElasticResume:
    """The resumed run's layout for a checkpoint's.

    Args:
        saved: The checkpoint's layout.
        world_size: Ranks of the resumed run.
        device_name: The resumed run's hardware.
        micro_batch: -b/--batch-size of the resumed run as parsed.
        accum_steps: --grad-accum-steps of the resumed run as parsed.
        user_flags: Flags the user set to values other than the checkpoint's; non-empty keeps the parsed layout.
    """
    if user_flags:
        now = BatchLayout(micro_batch, world_size, accum_steps, device_name)
        return ElasticResume(saved, now, tuple(user_flags), now.global_batch == saved.global_batch,
                             f'{" and ".join(user_flags)} set for this run: kept as given')
    if world_size == saved.world_size:
        now = BatchLayout(saved.micro_batch, world_size, saved.accum_steps, device_name)
        return ElasticResume(saved, now, (), True, 'same ranks: the checkpoint\'s layout')
    plan = plan_accumulation(saved.global_batch, world_size, saved.micro_batch)
    now = BatchLayout(plan.micro_batch, world_size, plan.accum_steps, device_name)
    if not plan.exact:
        return ElasticResume(saved, now, (), False, plan.reason.rstrip('.'))
    changes = [f'{what} {old} -> {new}' for what, old, new in (
        ('micro-batch', saved.micro_batch, now.micro_batch), ('accumulation', saved.accum_steps, now.accum_steps))
        if old != new]
    return ElasticResume(saved, now, (), True, ', '.join(changes) or 'the checkpoint\'s micro-batch and accumulation')


def resume_updates(updates_done: int, saved_global: int, new_global: int) -> int:
    """Updates of `new_global` samples that cover what `updates_done` updates of `saved_global` trained.

    Rounded down: the resumed run trains the few samples of a partial update again rather than skip them.
    """
    return updates_done * saved_global // new_global


def elastic_lr(plan: ElasticResume, checkpoint_lr: float, rule_lr: float, scale: str) -> float:
    """The LR of a resumed run whose global batch differs from the checkpoint's.

    A layout the user set gets train.py's LR for it (`rule_lr`: --lr, or --lr-base by the rule); a re-plan without
    an exact split moves the checkpoint's LR to the nearest global batch by the run's rule `scale` (as tune_batch.py
    does for an explicit --lr).
    """
    if plan.user_flags:
        return rule_lr
    return rescale_lr(checkpoint_lr, plan.saved.global_batch, plan.now.global_batch, scale)


def tune_hint(args_yaml: Optional[str], global_batch: int, world_size: int,
              topology: Optional[Topology] = None) -> str:
    """The tune_batch.py command that probes the micro-batch of `global_batch` on this device and world size: under
    a multi-node torchrun `topology` launched the same way on each node, else `--nproc` on this one."""
    config = f'-c {args_yaml} ' if args_yaml else ''
    options = f'{config}--target-global-batch {global_batch}'
    if topology is not None and topology.multi_node:
        launcher = ' '.join(['python -m torch.distributed.run', *topology.torchrun_options()])
        return f'{launcher} tune_batch.py {options} --dry-run'
    nproc = f' --nproc {world_size}' if world_size > 1 else ''
    return f'python tune_batch.py {options}{nproc} --dry-run'


def describe_change(plan: ElasticResume, saved_lr: Optional[float], lr: float, epoch: int,
                    updates_done: int, new_updates_done: int) -> str:
    """One log line: what changed between the checkpoint and the resumed run, and what was kept.

    Args:
        plan: The re-planned layout.
        saved_lr: The checkpoint's LR (None when it has no args).
        lr: The LR the resumed run trains with.
        epoch: The epoch the run resumes in.
        updates_done: Updates of that epoch the checkpoint had done (in its layout).
        new_updates_done: The same position in the resumed layout's updates.
    """
    saved, now = plan.saved, plan.now
    parts = [f'Elastic resume: the checkpoint trained {saved.describe()}, this run {now.describe()}']
    if plan.user_flags:
        parts.append(f'{" and ".join(plan.user_flags)} set for this run win over the re-plan')
    elif plan.layout_changed:
        parts.append(f're-planned for its {now.world_size} rank(s): {plan.reason}')
    if plan.global_changed:
        changed = f'global batch {saved.global_batch} -> {now.global_batch}'
        parts.append(f'{changed}, LR {saved_lr:g} -> {lr:g} by the run\'s rule' if saved_lr else changed)
    else:
        parts.append(f'same global batch, LR {lr:g} kept')
    if updates_done and plan.layout_changed:
        samples = updates_done * saved.global_batch
        parts.append(f'epoch {epoch} continues after {samples} samples (update {updates_done} of the checkpoint\'s '
                     f'layout is update {new_updates_done} of this one)')
    return '; '.join(parts) + '.'


def device_note(plan: ElasticResume, hint: str) -> str:
    """The warning for a resume on other hardware: the micro-batch was measured there, and how to probe here."""
    return (f'Elastic resume: the device changed ({plan.saved.device_name} -> {plan.now.device_name}); micro-batch '
            f'{plan.now.micro_batch} is what fitted there, not known to fit here. To probe this device for global '
            f'batch {plan.now.global_batch} on {plan.now.world_size} rank(s) run `{hint}` and resume with -c its '
            f'YAML (or add --oom-recover).')


def layout_flags_set_anew(given: Sequence[str], parsed: dict, saved: BatchLayout) -> Tuple[str, ...]:
    """Flags of the layout the resumed run sets (command line or -c YAML) to a value other than the checkpoint's.

    A value equal to the checkpoint's (the run's own args.yaml passed back with -c) is no new setting.
    """
    saved_values = {'batch_size': saved.micro_batch, 'grad_accum_steps': saved.accum_steps}
    return tuple(flag for dest, flag in LAYOUT_FLAGS.items()
                 if dest in given and parsed.get(dest) != saved_values[dest])
