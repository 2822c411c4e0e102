#!/usr/bin/env python3
"""Choose the batch that reaches the recipe's result soonest, plan accumulation and LR, write a config, and train.

    python tune_batch.py --data-dir /data/imagenet --model resnet50 --amp --mem-budget 0.9
    python tune_batch.py -c recipe.yaml --target-global-batch 4096 --nproc 8 --dry-run

Takes every train.py flag (the same parser definition) plus the batch-tuning group below. Steps: probe the largest
micro-batch under the memory budget with real training steps (`timm_ext.probe.train_probe`), plan accumulation for the
wanted global batch and the LR (`timm_ext.tune.plan`), write a YAML config (`timm_ext.tune.tuned_config`) that train.py
(ours or stock) reads with `-c`, print the trial table (once), the report and a closing summary ending in the train
command, then train unless `--dry-run`: in this process, once everything the probe built is released (the imports are
paid once; the probe's model, optimizer and allocator cache are gone). With `--nproc N` the probe runs on N ranks under
torchrun (each rank probes; they agree on the smallest), and once they have exited this process becomes
distributed_train.sh (`timm_ext.tune.handover`). Started by torchrun itself (several nodes, say), it probes and plans on
every rank and prints the train command with the topology it was started under (`timm_ext.launch`), for each node to
run.

The global batch is an optimisation choice, not a memory one (`--select auto`, the default): a global batch the
recipe sets is kept exactly; with none set, stock's -b 128 is the recipe, and a bigger one is chosen only when the
run is long enough to pay for measuring the gradient noise scale (`timm_ext.tune.critical_batch`) and the bigger
batch is predicted to reach the recipe's result clearly sooner, the run lengthened to match
(`timm_ext.tune.batch_choice`). The decisions are `timm_ext.tune.tuner`; this script parses, wires and trains.

A `--train-img-sizes` schedule gets a batch per size (`timm_ext.tune.img_sizes`): each size probed and written as
`train_batch_sizes` (a stock key), each the largest that fits, with the LR of the schedule's average batch as timm
computes it; `--train-batch-sizes` the recipe sets are kept (each checked with one trial), and a recipe's `-b` or
`--target-global-batch` stays the batch at every size, as in stock.

The evaluation between epochs keeps no activations for a backward pass, so several times the training micro-batch
fits: when the run evaluates long enough for a few forward-only trials to pay (`plan_eval_batch`), they find the
largest eval batch within the same budget and the YAML sets `validation_batch_size` (a stock key).
"""
import argparse
import functools
import importlib.util
import os
import signal
import subprocess
import sys
from typing import List, Optional, Set

from timm import utils

from timm_ext.arg_checks import TRAIN_DOMAINS, TUNE_DOMAINS, writable_file_problem
from timm_ext.cuda_backends import configure_cuda_backends
from timm_ext.memory_model.snapshot import add_snapshot_argument, snapshot_flag_problem
from timm_ext.distributed import DeviceError, check_device, end_process_group, exit_process, init_device
from timm_ext.errors import TimmExtError, report
from timm_ext.launch import current_topology, planned_topology
from timm_ext.memory import default_headroom, trains_on_steady_heap
from timm_ext.memory_model.cards import CARDS, card_flag_problem
from timm_ext.memory_model.versions import add_software_argument, software_flag_problem
from timm_ext.memory_model.estimate import EstimateError
from timm_ext.child_process import die_with_parent
from timm_ext.probe.selection import SELECT_MODES
from timm_ext.probe.table import NothingFitsError
from timm_ext.train.args import EXTENSIONS_GROUP, build_parser, given_dests, group_dests, parse_args
from timm_ext.train.batch_ramp import with_noise_scale
from timm_ext.train.setup import check_arg_combinations, check_inputs, with_values
from timm_ext.tune.handover import exec_training, release_probe
from timm_ext.tune.img_sizes import format_size_table, schedule_mode
from timm_ext.tune.tuned_config import extension_flags, planned_command, train_command, tuned_config, write_tuned_config
from timm_ext.tune.plot import write_probe_plot
from timm_ext.tune.estimate_plan import check_estimate_inputs, plan_with_estimate, probe_savers
from timm_ext.tune.savers import SAVER_NAMES, apply_savers, nothing_fits_advice
from timm_ext.tune.tuner import (
    EVAL_PROBE_MODES, default_config_path, plan_tuned_run, report_lines, shown_report, summary_lines, worth_a_plot,
)

TUNE_GROUP = 'Batch tuning (tune_batch.py)'
SCRIPT_DIR = os.path.dirname(os.path.abspath(__file__))
# The probe's group timeout where --dist-timeout is not given: a trial is one step, so a rank that has not joined
# an agreement within 10 minutes is stuck, not slow (training keeps the backend's default, as stock)
PROBE_TIMEOUT_S = 600.0
SELECTIONS = ('auto', 'critical') + SELECT_MODES


class AppendSaver(argparse.Action):
    """--apply-saver, repeatable: each use adds a name (argparse's 'append' cannot start from the sentinel default
    `given_dests` parses with)."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [*(names if isinstance(names, list) else []), values])


class StoppedByLauncher(TimmExtError):
    """torchrun stopped this probing rank (SIGTERM), as it stops every rank once one has failed."""
    exit_status = 128 + signal.SIGTERM
    label = ''  # 'tune_batch.py: rank 1 stopped by SIGTERM ...': what happened to it, not its error


def _stopped_by_launcher(signum, frame) -> None:
    # torchrun's SIGTERM would end the rank without a word, leaving its log mute about why it ended
    raise StoppedByLauncher(f'rank {os.environ.get("RANK", "?")} stopped by SIGTERM: torchrun ends every rank once '
                            'one has failed (the failed rank\'s own line says why)')


def build_tune_parser() -> argparse.ArgumentParser:
    """train.py's parser with the batch-tuning group added."""
    parser = build_parser(description='Probe the largest batch that fits, plan accumulation and LR, then train',
                          prog='tune_batch.py')
    group = parser.add_argument_group(TUNE_GROUP, 'How the batch is probed and the run planned.')
    group.add_argument('--mem-budget', default=None, metavar='SIZE',
                       help="memory the run may use: a size ('12GiB', '500MB') or a fraction of the device ('0.8'); "
                            "on CUDA what the caching allocator may use (the CUDA context is outside it), on CPU "
                            "memory above what the process holds when probing starts (default: all)")
    group.add_argument('--gpu', default=None, metavar='NAME',
                       help='with --estimate: plan for this card (' + ', '.join(CARDS) + '): its memory as CUDA '
                            'reports it less the CUDA context, and its compute capability; --mem-budget then may '
                            'not pass what the card leaves the caching allocator')
    add_software_argument(group)
    group.add_argument('--mem-headroom', type=float, default=None, metavar='FRAC',
                       help='fraction of the budget the chosen batch leaves free, judged on measured peak memory '
                            '(default: 0.05 on CPU, where peaks are the same in every process; 0.1 on a CUDA device; '
                            'with --estimate on CUDA the model\'s error measured on timm\'s GPU tables, which the '
                            'plan names)')
    group.add_argument('--select', default='auto', choices=SELECTIONS,
                       help="auto: keep the recipe's global batch (-b x ranks x --grad-accum-steps, or "
                            "--target-global-batch) at its fastest split; when the recipe sets none, a bigger one "
                            "only if the run is long enough to measure the noise scale and a bigger batch is predicted "
                            "to reach the result clearly sooner (the run lengthened to match). critical: judge a "
                            "bigger global batch that way even when the recipe sets one. max: the largest micro-batch "
                            "that fits. throughput: the fastest micro-batch for the recipe's global batch")
    group.add_argument('--throughput-tol', type=float, default=0.05, metavar='FRAC',
                       help='how far below the best samples/s still counts as best (--select throughput)')
    group.add_argument('--batch-multiple', type=int, default=None, metavar='N',
                       help='the fine step of the probe: it tries only multiples of N (default: 8 on CUDA, '
                            'for tensor cores; 1 on CPU)')
    group.add_argument('--max-batch', type=int, default=None, metavar='N',
                       help='largest micro-batch worth trying (the dataset size per rank is always a limit)')
    group.add_argument('--probe-start', type=int, default=2, metavar='N',
                       help='first micro-batch tried; its measured peak aims the next trial at the budget')
    group.add_argument('--target-global-batch', type=int, default=None, metavar='N',
                       help="keep a recipe's global batch: micro-batch x ranks x accumulation = N (exactly when a "
                            "split exists, else the nearest, with the LR rescaled)")
    group.add_argument('--nproc', type=int, default=1, metavar='N',
                       help='train on N processes of this node (through distributed_train.sh); each probes')
    group.add_argument('--tuned-config', default=None, metavar='PATH',
                       help='where to write the YAML config (default: ./output/tune/<model>-<img size>.yaml)')
    group.add_argument('--eval-probe', default='auto', choices=EVAL_PROBE_MODES,
                       help='auto: probe the eval batch (validation_batch_size) only when its few forward-only trials '
                            'are predicted to cost at most 5%% of the run\'s evaluations; on: always (where the '
                            'validation split holds more than the micro-batch); off: never')
    group.add_argument('--dry-run', action='store_true', default=False,
                       help='probe and plan, write the config and print the command, but do not train')
    group.add_argument('--no-cache', action='store_true', default=False,
                       help='probe again even if an identical request is cached')
    group.add_argument('--estimate', action='store_true', default=False,
                       help='decide from the memory estimate alone (train.py\'s step traced on fake tensors): no real '
                            'trial, no device needed, so --device cuda plans a GPU run on any machine; --mem-budget '
                            'may then list several sizes (24GiB,80GiB) for a table of what fits where')
    group.add_argument('--nnodes', type=int, default=1, metavar='N',
                       help='with --estimate: plan for N nodes of --nproc processes each (nothing is launched)')
    group.add_argument('--apply-saver', action=AppendSaver, default=None, choices=SAVER_NAMES, metavar='NAME',
                       help='plan with this memory saver on (repeatable) and write its stock flags into the config: '
                            + ', '.join(SAVER_NAMES) + '; the plan\'s savers table prices each one')
    group.add_argument('--savers', action='store_true', default=False,
                       help='print the memory savers\' table (what each saver the run does not use yet would give) '
                            'even where the plan neither accumulates nor misses the budget')
    add_snapshot_argument(group)
    return parser


def _check_tune_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Rules between tune_batch's flags (each flag's own range is checked by the parser: TUNE_DOMAINS)."""
    if args.select == 'critical' and args.target_global_batch:
        parser.error('argument --select critical: it chooses the global batch itself; drop --target-global-batch')
    problem = writable_file_problem('--tuned-config', args.tuned_config or default_config_path(args))
    if problem:
        parser.error(problem)
    if args.mem_budget and ',' in args.mem_budget and not args.estimate:
        parser.error('argument --mem-budget: several budgets are for --estimate; give one, or add --estimate')
    problem = snapshot_flag_problem(args.memory_snapshot, args.estimate, args.device)
    if problem:
        parser.error(problem)
    problem = card_flag_problem(args.gpu, args.device, args.estimate) \
        or software_flag_problem(args.software, args.device, args.estimate)
    if problem:
        parser.error(problem)
    if args.nnodes != 1 and not args.estimate:
        parser.error('argument --nnodes: plans several nodes only with --estimate; to probe on several nodes, start '
                     'tune_batch.py under torchrun on each')


def main(argv: Optional[List[str]] = None) -> int:
    utils.setup_default_logging()
    if 'TORCHELASTIC_RUN_ID' in os.environ:  # a probing rank: end with its launcher, as its trials end with it
        die_with_parent(os.getppid())
        signal.signal(signal.SIGTERM, _stopped_by_launcher)
    parser = build_tune_parser()
    args, _ = parse_args(argv, parser=parser, domains={**TRAIN_DOMAINS, **TUNE_DOMAINS})
    _check_tune_args(parser, args)
    prog = parser.prog
    try:
        args, saver_notes = apply_savers(args, args.apply_saver)
        for note in saver_notes:
            print(note)
        args, ramp_line = with_noise_scale(args, int(os.environ.get('WORLD_SIZE', args.nproc)))
        if ramp_line and os.environ.get('RANK', '0') == '0':
            print(ramp_line)
        # everything train.py would refuse, before any probe (ranks under torchrun read the world from the environment)
        check_arg_combinations(args, world_size=None if 'WORLD_SIZE' in os.environ else args.nproc)
        given = given_dests(argv, parser)
        schedule_mode(args, given)  # a schedule it cannot honour is refused before any probe
        if args.estimate:  # the data and the device may be on the machine the plan is for, not here
            check_estimate_inputs(args)
            return tune_from_estimate(parser, args, given)
        check_inputs(args)
        if args.nproc > 1 and 'WORLD_SIZE' not in os.environ:
            return relaunch_under_torchrun(parser, args, sys.argv[1:] if argv is None else argv)
        return tune(parser, args, given)
    except TimmExtError as e:
        return report(prog, e)
    except KeyboardInterrupt:
        print(f'{prog}: interrupted; the memory cap is lifted and nothing was cached or written', file=sys.stderr)
        return 130
    finally:
        end_process_group(wait=False)  # a rank that failed: its peers may never arrive (no-op once `tune` ended it)


def relaunch_under_torchrun(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: List[str]) -> int:
    """Probe on `--nproc` ranks (torchrun, --dry-run), then launch training from here through distributed_train.sh."""
    try:  # each rank would refuse a missing GPU alone, and torchrun would add its own traceback
        if args.device.split(':', 1)[0] == 'cuda':
            check_device(args.device, local_rank=args.nproc - 1)
    except DeviceError as e:
        return report(parser.prog, e)
    config_path = args.tuned_config or default_config_path(args)
    # the ranks learn the world size from torchrun; an '--nproc' token would also trip torchrun's own parser
    rank_argv, skip = [], False
    for token in argv:
        if skip or token == '--nproc' or token.startswith('--nproc='):
            skip = token == '--nproc'
            continue
        rank_argv.append(token)
    probe_cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={args.nproc}',
                 os.path.join(SCRIPT_DIR, 'tune_batch.py'), *rank_argv, '--dry-run', '--tuned-config', config_path]
    rc = subprocess.call(probe_cmd, preexec_fn=functools.partial(die_with_parent, os.getpid()))
    if rc != 0 or args.dry_run:
        return rc
    with open(config_path) as f:  # the command rank 0 planned, with the flags it added from what it measured
        command = planned_command(f.read())
    if command is None:
        extras = extension_flags(args, parser, group_dests(parser, EXTENSIONS_GROUP))
        command = train_command(sys.executable, SCRIPT_DIR, config_path, args.nproc, extras)
    return exec_training(command)  # the probe ranks have exited; this process becomes the launcher


def with_measured_heap(args: argparse.Namespace, device) -> argparse.Namespace:
    """`args` with ``--steady-cpu-heap`` on where the batch was measured on it (`trains_on_steady_heap`): the train
    command then peaks as the trials did, whenever a cap comes."""
    return with_values(args, steady_cpu_heap=True) if trains_on_steady_heap(device, bool(args.mem_budget)) else args


def tune(parser: argparse.ArgumentParser, args: argparse.Namespace, given: Set[str]) -> int:
    train_args = args  # as parsed: what the config describes (init_device's copy holds the runtime fields)
    args, device = init_device(args, default_timeout_s=PROBE_TIMEOUT_S)
    if args.mem_headroom is None:
        args.mem_headroom = default_headroom(device)
    configure_cuda_backends(device)  # trials time the regime train.py runs in
    world_size = args.world_size if args.distributed else args.nproc
    primary = args.rank == 0
    config_path = args.tuned_config or default_config_path(args)
    try:
        tuned = plan_tuned_run(parser, args, given, device, world_size, config_path)
    except NothingFitsError as e:
        raise with_savers_advice(e, args, given, device, world_size) from None
    train_args = with_measured_heap(train_args, device)
    release_probe(device, bool(args.torchcompile))
    # the recipe's micro-batch does not fit the memory (a trial failed it): what each memory saver would give instead
    memory_bound = tuned.outcome is not None and any(trial.accepted is False for trial in tuned.outcome.trials)
    saver_lines = probe_savers(args, given, device.type, world_size, tuned.plan.micro_batch)[0] if (
        (args.savers or memory_bound and tuned.plan.accum_steps > 1) and not args.distributed
        and tuned.size_batches is None) else []

    values = dict(tuned.schedule)
    if tuned.eval_batch is not None:
        values['validation_batch_size'] = tuned.eval_batch
    if tuned.size_batches is not None:
        values['train_batch_sizes'] = tuned.size_batches
    flags = ['--batch-ramp-max-micro', str(tuned.ramp_max_micro)] if tuned.ramp_max_micro is not None else []
    if tuned.outcome is None and not args.oom_recover:
        flags.append('--oom-recover')  # no trial ran: train.py's first update is the trial (`timm_ext.tune.untried`)
    topology = current_topology() if args.distributed else None  # the launch training must repeat
    config = tuned_config(train_args, parser, tuned.plan, config_path, SCRIPT_DIR, world_size, topology, values, flags)
    command = config.command
    if primary:
        tables = ['']  # the trials were printed as they ran (or from the cache); the per-size table sums them up
        if tuned.sizes:
            wanted = tuned.size_batches if 'train_batch_sizes' in given else None
            tables += ['Per size:', format_size_table(tuned.sizes, wanted), '']
        print('\n'.join(tables))
        plot = write_probe_plot(os.path.splitext(config_path)[0] + '.png', tuned.outcome.trials,
                                tuned.plan.micro_batch, tuned.choice) if worth_a_plot(tuned) else None
        report = report_lines(tuned, args, config.flags) + saver_lines
        write_tuned_config(config, report, [f'Plot: {plot}'] if plot else [], summary_lines(tuned),
                           shown=shown_report(tuned, report))
    multi_node = topology is not None and topology.multi_node
    if multi_node and primary:
        print(f'Run it on each of the {topology.nnodes} nodes as tune_batch.py was (each node prints its own).')
    elif multi_node and args.local_rank == 0:
        print(f'Train command on this node: {config.command_line}', flush=True)
    if args.distributed:
        end_process_group()
        if primary and not args.dry_run:
            print('Under torchrun tune_batch.py probes and plans only; run the train command above to train.')
        return 0
    if args.dry_run:
        return 0
    # train here: the imports are paid once, and nothing of the probe is alive any more (plan_tuned_run, release_probe)
    return load_train_script().main(command[2:])


def with_savers_advice(error: NothingFitsError, args: argparse.Namespace, given: Set[str], device,
                       world_size: int) -> NothingFitsError:
    """The probe's nothing-fits error with the cheapest memory saver that fits named, each saver a line under it
    (one process only: under torchrun every rank would trace them)."""
    if args.distributed:
        return error
    advice, details = nothing_fits_advice(probe_savers(args, given, device.type, world_size, 0)[1])
    priced = NothingFitsError(f'{error}; {advice}', error.trials)
    priced.details = details
    return priced


def tune_from_estimate(parser: argparse.ArgumentParser, args: argparse.Namespace, given: Set[str]) -> int:
    """--estimate: plan every budget from the memory estimate, write the first budget's config, print the command."""
    try:
        planned = plan_with_estimate(args, given)
    except (EstimateError, NothingFitsError) as e:
        return report(parser.prog, e)
    config_path = args.tuned_config or default_config_path(args)
    topology = planned_topology(args.nnodes, args.nproc)
    values = {} if planned.eval_batch is None else {'validation_batch_size': planned.eval_batch}
    config = tuned_config(with_measured_heap(args, args.device), parser, planned.plans[0].plan, config_path,
                          SCRIPT_DIR, args.nproc, topology, values)
    notes = [] if topology is None else [
        f'Run the command on each of the {args.nnodes} nodes, MASTER_HOST set to the first node\'s address.']
    write_tuned_config(config, planned.lines, notes)
    first = planned.plans[0]
    if args.memory_snapshot and planned.estimate.replay is not None:
        try:
            print('\n'.join(planned.estimate.replay.save_snapshot(
                first.plan.micro_batch, first.usable, args.memory_snapshot, planned.estimate.describe,
                accumulating=first.plan.accum_steps > 1)))
        except OSError as e:
            return report(parser.prog, TimmExtError(f'--memory-snapshot {args.memory_snapshot}: cannot write it '
                                                    f'({e.strerror}); pass a writable path'))
    return 0


def load_train_script():
    """train.py (beside this script) as a module."""
    spec = importlib.util.spec_from_file_location('train', os.path.join(SCRIPT_DIR, 'train.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == '__main__':
    exit_process(main())
