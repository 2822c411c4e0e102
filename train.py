#!/usr/bin/env python3
"""Train a timm image model: a drop-in replacement for timm's train.py.

Every stock flag and `-c/--config` YAML works as in timm; what differs is fixed behaviour: exactly ceil(n/k)
optimizer updates per epoch with gradient accumulation (a true mean in the shorter last window), no host sync per
micro-batch, crash-safe checkpoints with a resume that continues inside an interrupted epoch, DDP on CPU (gloo),
safetensors export of the best and last weights, one-line errors for bad input (`timm_ext.arg_checks`), a full disk
or a lost DDP rank, and SIGTERM / SIGINT ending the run after a complete update saved as a recovery checkpoint
(exit 128 + signal; stock exits 0 on Ctrl-C and dies mid-step on SIGTERM). Beyond stock: `--oom-recover`
survives out-of-memory errors with the same updates (smaller micro-batches, more accumulation), and
`--log-noise-scale` estimates the critical batch size (noise_scale.csv).

    python train.py --data-dir /data/imagenet --model resnet50 -b 128 --amp
    ./distributed_train.sh 8 -c recipe.yaml

The script parses the arguments and maps errors to exit statuses; the run's phases are
`timm_ext.train.run.TrainingRun`, its loop `timm_ext.train.loop.TrainLoop`.
"""
import logging
import sys
from typing import AbstractSet

import torch
from timm import utils
from timm.utils import world_info_from_env

from timm_ext.distributed import end_process_group, exit_process, lost_peer
from timm_ext.errors import TimmExtError, report
from timm_ext.oom import is_oom
from timm_ext.train.args import args_to_yaml, build_parser, given_dests, parse_args
from timm_ext.train.batch_ramp import with_noise_scale
from timm_ext.train.run import TrainingRun
from timm_ext.train.setup import check_arg_combinations, check_inputs


def main(argv=None, prog: str = 'train.py') -> int:
    """Train from a command line (default `sys.argv[1:]`); tune_batch.py calls this in-process after probing."""
    if not logging.getLogger().handlers:  # a caller that set up logging keeps its handler (no doubled lines)
        utils.setup_default_logging()
    args, args_text = parse_args(argv)
    finished = False
    try:
        args, ramp_line = with_noise_scale(args, world_info_from_env()[2])
        if ramp_line:  # the ramp's measurement turned on: args.yaml holds what the run trains with
            logging.getLogger('train').info(ramp_line)
            args_text = args_to_yaml(args)
        check_arg_combinations(args)
        check_inputs(args)
        status = train(args, args_text, given_dests(argv, build_parser()))
        finished = True
        return status
    except TimmExtError as e:  # bad input, a device or checkpoint problem, a stop on a signal: one line
        return report(prog, e)
    except KeyboardInterrupt:
        print(f'{prog}: interrupted; the checkpoints on disk are complete, resume from the newest', file=sys.stderr)
        return 130
    except torch._dynamo.exc.BackendCompilerFailed as e:  # a RuntimeError: handled before the lost-peer check
        reason = ' '.join(str(e).split())[:200]
        if is_oom(e) or "can't start new thread" in str(e):  # a capped process: the compile's own memory
            print(f'{prog}: error: --torchcompile {args.torchcompile} ran out of memory while compiling the model '
                  f'({reason}); raise the memory budget or run without --torchcompile', file=sys.stderr)
        else:
            print(f'{prog}: error: --torchcompile {args.torchcompile} could not compile the model ({reason}); '
                  f'run without --torchcompile or pick another backend', file=sys.stderr)
        return 1
    except RuntimeError as e:
        if not lost_peer(e):
            raise
        reason = ' '.join(str(e).split())[:160]
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        print(f'{prog}: error: rank {rank} lost contact with the other processes of the run (one died, stalled past '
              f'--dist-timeout or the network failed: {reason}); stopping, the checkpoints on disk are complete',
              file=sys.stderr)
        return 1
    finally:
        end_process_group(wait=finished)  # every rank that finished waits for the others before the group goes


def train(args, args_text: str, given: AbstractSet[str] = frozenset()) -> int:
    """Train the run `args` describes; `given` names the dests the command line or its -c YAML set."""
    return TrainingRun(args, args_text, given).run()


if __name__ == '__main__':
    exit_process(main())
