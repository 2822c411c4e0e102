"""Each memory saver's predicted micro-batch against the largest one real CPU trials hold with that saver on.

    python bench/bench_savers.py                                    # three models, 512 MiB, AdamW, oneDNN off
    python bench/bench_savers.py --models resnet18:96 --budget 1GiB
    python bench/bench_savers.py --skip ''                         # the AMP rows too (a CPU with half kernels)

For each model the savers table's rows on CPU (`timm_ext.tune.savers.candidate_savers`: AMP float16 and bfloat16,
gradient checkpointing, channels_last, SGD instead of AdamW, a smaller input) plus the run as it is: the estimate's
largest batch within the budget (no headroom, as `bench/bench_estimate.py`), then the largest batch whose warm-up
update and one timed update hold under the cap (RLIMIT_DATA), searched from that prediction in a fresh process with the
saver's flags on (`bench_estimate.oracle`: train.py's builder, its steady heap, each trial forked). Memory figures only.
The AMP rows are skipped by default: on a CPU without bfloat16 or float16 kernels (AVX2 only, as here) one float16
trial of resnet18 at batch 155 ran for minutes.
"""
import argparse
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_estimate import oracle, run_args  # noqa: E402  (the bench folder is not a package)

DEFAULT_MODELS = ('resnet18:96', 'vit_tiny_patch16_224:224', 'convnext_atto:96')
RECIPE = ('--opt', 'adamw')  # two state tensors a weight: the SGD row has something to save
TARGET = 0.10  # the bar: predicted within 10% of what the trials hold


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', nargs='+', default=list(DEFAULT_MODELS), metavar='MODEL:IMG')
    parser.add_argument('--budget', default='512MiB')
    parser.add_argument('--skip', default='amp-float16,amp-bfloat16', help='savers not measured (comma-separated)')
    args = parser.parse_args()
    from timm_ext.memory import parse_budget
    from timm_ext.memory_model.estimate import estimate_memory
    from timm_ext.tune.savers import candidate_savers
    budget = parse_budget(args.budget).num_bytes
    print(f'| model | img | saver | flags | predicted | trials hold | predicted / held |   (budget {args.budget})')
    print('|---|---|---|---|---|---|---|')
    errors = []
    for spec in args.models:
        model, img = spec.split(':')
        base = estimate_memory(run_args(model, img, *RECIPE), 'cpu')
        rows = [('(as is)', ())] + [(saver.name, tuple(shlex.split(saver.flags)))
                                    for saver in candidate_savers(run_args(model, img, *RECIPE), 'cpu', base)
                                    if saver.name not in args.skip.split(',')]
        for name, flags in rows:
            started = time.perf_counter()
            predicted = estimate_memory(run_args(model, img, *RECIPE, *flags), 'cpu').largest_batch(budget)
            held = oracle(model, img, args.budget, False, (*RECIPE, *flags), start=max(1, predicted))
            ratio = predicted / max(1, held)
            errors.append(abs(ratio - 1))
            print(f'| {model} | {img} | {name} | `{" ".join(flags) or "-"}` | {predicted} | {held} | {ratio:.2f} |   '
                  f'({time.perf_counter() - started:.0f} s)', flush=True)
    within = sum(error <= TARGET for error in errors)
    print(f'RESULT: {within} of {len(errors)} rows within {TARGET:.0%}; largest miss {max(errors):.0%}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
