#!/usr/bin/env python3
"""Validate timm models on an image dataset: a drop-in replacement for timm's validate.py.

Same command line and results as the stock script. Differences: `--retry` (always on in bulk mode) probes the
largest batch that fits before building loaders, then evaluates once; a CPU-only machine falls back from the
default `--device cuda`; bad input ends in one line on stderr, and in bulk mode a failing model gets an `error`
field while the others go on; results files are written atomically.

    python validate.py --data-dir DIR --model resnet50 --checkpoint model_best.pth.tar --retry -b 1024
"""
import json
import logging
import shlex
import sys

from timm.utils import setup_default_logging

from timm_ext.cuda_backends import configure_cuda_backends
from timm_ext.errors import TimmExtError
from timm_ext.memory import free_memory
from timm_ext.memory_model.allocator_config import allocator_config
from timm_ext.memory_model.versions import run_software
from timm_ext.probe.grids import default_grid
from timm_ext.validate.batch_estimate import estimate_eval_batch
from timm_ext.validate.results import write_results
from timm_ext.validate.args import parse_validate_args
from timm_ext.validate.jobs import JobsError, resolve_jobs
from timm_ext.validate.evaluate import ValidationError, resolve_device, validate_model
from timm_ext.validate.weights import one_line

_logger = logging.getLogger('validate')


def fail(message: str, status: int = 1) -> int:
    print(f'validate.py: error: {message}', file=sys.stderr)
    return status


def error_message(exc: Exception) -> str:
    """One line for any failure: the message of a ValidationError, else the exception type and first line."""
    return str(exc) if isinstance(exc, ValidationError) else f'{type(exc).__name__}: {one_line(exc)}'


def run_bulk(args, jobs, device):
    """Validate each (model, checkpoint) with the probe on; a failure becomes that model's `error` row."""
    done, failed = [], []
    for model_name, checkpoint in jobs:
        try:
            row = validate_model(args, model_name, checkpoint, device, probe_first=True)
        except KeyboardInterrupt:
            _logger.warning('Interrupted: writing the results gathered so far.')
            break
        except Exception as e:
            row = {'model': model_name, 'error': error_message(e)}
            _logger.error(f'{model_name} failed to validate: {row["error"]}')
            failed.append(row)
        else:
            done.append(row)
        if checkpoint:
            row['checkpoint'] = checkpoint
        free_memory(device)  # the next model starts from what this one left
    return sorted(done, key=lambda r: r['top1'], reverse=True) + failed, bool(done) or not failed


def plan_from_estimate(args, argv) -> int:
    """--estimate: the largest batch predicted within --mem-budget, and the command that validates at it."""
    device_type = args.device.split(':', 1)[0]
    try:
        if device_type == 'cuda':  # the allocator options the run starts with: its torch's reading, or one line
            allocator_config(software=run_software(args.software)[0])
        planned = estimate_eval_batch(args, args.model, device_type, args.mem_budget)
    except TimmExtError as e:
        return fail(str(e), getattr(e, 'exit_status', 1))
    budget_text = args.mem_budget or args.gpu or f'the {device_type} device'
    print('\n'.join(planned.lines(budget_text)))
    if planned.batch_size < 1:
        return fail(f'{args.model} is predicted not to fit {budget_text} even at batch size 1')
    batch = default_grid(device_type, None).snap(planned.batch_size)  # a multiple of 8 on CUDA, for tensor cores
    if args.memory_snapshot and planned.estimate.replay is not None:
        try:
            print('\n'.join(planned.estimate.replay.save_snapshot(batch, planned.usable, args.memory_snapshot,
                                                                  planned.estimate.describe)))
        except OSError as e:
            return fail(f'--memory-snapshot {args.memory_snapshot}: cannot write it ({e.strerror}); pass a writable '
                        f'path')
    kept, skip = [], False
    for token in sys.argv[1:] if argv is None else argv:  # the same command, less the planning flags, at the batch
        valued = ('--mem-budget', '--gpu', '--software', '-b', '--batch-size', '--memory-snapshot')
        if skip or token in ('--estimate', *valued) or token.startswith(tuple(f'{f}=' for f in valued if f[1] == '-')):
            skip = token in valued
            continue
        kept.append(token)
    command = [sys.executable, sys.argv[0] or 'validate.py', *kept, '--batch-size', str(batch), '--retry']
    print(f'Validate command: {shlex.join(command)}')
    return 0


def main(argv=None) -> int:
    setup_default_logging()
    args = parse_validate_args(argv)
    if args.estimate:
        return plan_from_estimate(args, argv)
    try:
        plan = resolve_jobs(args.model, args.checkpoint)
        device = resolve_device(args.device)
    except (JobsError, ValidationError) as e:
        return fail(str(e), 2)
    configure_cuda_backends(device)  # TF32 and cuDNN autotuning, as stock validate.py

    if plan.bulk:
        _logger.info(f'Bulk validation of {plan.description}: ' + ', '.join(m for m, _ in plan.jobs[:20])
                     + (' ...' if len(plan.jobs) > 20 else ''))
        results, ok = run_bulk(args, plan.jobs, device)
    else:
        model_name, checkpoint = plan.jobs[0]
        try:
            results, ok = validate_model(args, model_name, checkpoint, device, probe_first=args.retry), True
        except Exception as e:
            return fail(error_message(e))

    if args.results_file:
        write_results(args.results_file, results, args.results_format)
    print(f'--result\n{json.dumps(results, indent=4)}')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
