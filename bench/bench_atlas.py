"""What fits where: the largest training micro-batch and eval batch of timm's most used models on six named cards.

    python bench/bench_atlas.py               # writes docs/what-fits.md and docs/what-fits.csv (traces cached)
    python bench/bench_atlas.py --models resnet50,vit_base_patch16_224
    python bench/bench_atlas.py --configs 'fp16 adamw ckpt'   # trace one step's rows; keep the page's others

Every figure is `tune_batch.py --estimate`'s CUDA estimate for train.py's own step at the model's default resolution:
AMP (float16 and bfloat16), SGD (momentum 0.9) or AdamW, train.py's defaults otherwise (prefetcher, label smoothing),
one process, no headroom; the eval batch is validate.py's forward (float16). Each card is tune_batch.py's `--gpu NAME`
(`timm_ext.memory_model.cards`): its memory as CUDA reports it less the CUDA context, its compute capability. A row is
marked where one of timm's published
tables confirms the CUDA model for that model (`bench/bench_gpu_tables.py`: the estimate inside the table's rung).
"""
import argparse
import csv
import json
import os
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'bench'))
from atlas_models import MODELS  # noqa: E402

CACHE = os.path.join(ROOT, 'bench', 'results', 'atlas_traces.json')
DOC = os.path.join(ROOT, 'docs', 'what-fits.md')
TABLE = os.path.join(ROOT, 'docs', 'what-fits.csv')
ATLAS_CARDS = ('t4', 'rtx4090', 'a100-40gb', 'l40s', 'h100-80gb', 'h200')  # 16, 24, 40, 48, 80 and 141 GB
CONFIGS = {  # row -> (step, flags)
    'fp16 sgd': ('train', ('--amp', '--opt', 'sgd', '--momentum', '0.9')),
    'fp16 adamw': ('train', ('--amp', '--opt', 'adamw')),
    'bf16 sgd': ('train', ('--amp', '--amp-dtype', 'bfloat16', '--opt', 'sgd', '--momentum', '0.9')),
    'bf16 adamw': ('train', ('--amp', '--amp-dtype', 'bfloat16', '--opt', 'adamw')),
    'eval fp16': ('validate', ('--amp',)),
    'fp16 adamw ckpt': ('train', ('--amp', '--opt', 'adamw', '--grad-checkpointing')),
}
OPTIONAL = {'fp16 adamw ckpt'}  # a row only where the step traces with it
# bfloat16 holds what float16 holds in the CUDA model (the same casts, two bytes an element, the same kernel limits),
# so its rows come from the float16 trace; tests/test_atlas.py traces one in bfloat16 to check it
TRACED_AS = {'bf16 sgd': 'fp16 sgd', 'bf16 adamw': 'fp16 adamw'}


def trace(model: str, config: str) -> dict:
    from timm_ext.memory_model.estimate import EstimateError, estimate_memory
    from timm_ext.train.args import parse_args
    step, flags = CONFIGS[config]
    args, _ = parse_args(['--model', model, '--device', 'cuda', '--num-classes', '1000', *flags])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    batches = (16, 32, 64) if step == 'train' else (32, 64, 128)
    try:
        e = estimate_memory(args, 'cuda', batches=batches, step_kind=step)
    except EstimateError as error:
        return dict(error=str(error))
    return e.to_json()


def largest(entry: dict, card_name: str, config: str) -> Optional[int]:
    """The largest batch of a traced `config` on the named card, all of it (None: not traced)."""
    from timm_ext.memory_model.cards import CARDS
    from timm_ext.memory_model.devices import device_model
    from timm_ext.memory_model.estimate import MemoryEstimate
    if 'error' in entry:
        return None
    card = CARDS[card_name]
    return MemoryEstimate.from_json(entry, device_model('cuda', card=card)).largest_batch(card.allocator_bytes)


def table_kind(config: str) -> str:
    """The kind of published table that can confirm a row of `config`: 'train' or 'infer'."""
    return 'train' if CONFIGS[config][0] == 'train' else 'infer'


def confirmations() -> Dict[tuple, str]:
    """(model, 'train' or 'infer') -> the published tables whose rung the table-software estimate of that model
    hits."""
    import bench_gpu_tables as tables
    cache, found = tables.read_cache(), {}
    for r in tables.read_rows():
        table = tables.TABLES[r['source']]
        entry = cache.get(table.trace_key(r['model'], r['img_size']))
        if table.compiled or not r['next_rung'] or entry is None or 'error' in entry:  # the atlas plans eager steps
            continue
        if r['batch'] <= tables.predicted(entry, r['source']) < r['next_rung']:
            found.setdefault((r['model'], table.kind), []).append(f"{table.card.rsplit(' ', 2)[0]} {r['img_size']} px")
    return {key: ', '.join(v) for key, v in found.items()}


def read_cache() -> Dict[str, dict]:
    """The traces of the cache file and of every shard's (`--shard`), those of an older format left out (no event
    log recorded)."""
    cache = {}
    folder = os.path.dirname(CACHE)
    stem = os.path.basename(CACHE).removesuffix('.json')
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if name.startswith(stem) and name.endswith('.json'):
            with open(os.path.join(folder, name)) as f:
                cache.update({k: e for k, e in json.load(f).items() if 'error' in e or 'log' in e})
    return cache


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', default=','.join(MODELS))
    parser.add_argument('--fresh', action='store_true')
    parser.add_argument('--configs', default=','.join(CONFIGS),
                        help='the steps traced; the rows of the others are kept from the CSV written before')
    parser.add_argument('--shard', default=None, metavar='I/N',
                        help='only trace every N-th missing trace from the I-th, into a cache file of its own, and '
                             'write nothing else (run once more without it to write the page from every shard)')
    args = parser.parse_args(argv)
    started = time.perf_counter()
    models = [m for m in args.models.split(',') if m]
    traced = {c for c in args.configs.split(',') if c}
    kept = {(r['model'], r['config']): r for r in csv.DictReader(open(TABLE))} if traced != set(CONFIGS) else {}
    cache = {} if args.fresh else read_cache()
    todo = [(m, c) for m in models for c in CONFIGS if c in traced and c not in TRACED_AS and f'{m}|{c}' not in cache]
    shard, shards = map(int, (args.shard or '0/1').split('/'))
    own = CACHE if args.shard is None else CACHE.replace('.json', f'.{shard}of{shards}.json')
    os.makedirs(os.path.dirname(CACHE), exist_ok=True)
    for i, (model, config) in enumerate(todo[shard::shards], 1):
        cache[f'{model}|{config}'] = trace(model, config)
        entry = cache[f'{model}|{config}']
        status = entry.get('error') or f"{entry['seconds']:.1f} s"
        print(f'[{i}/{len(todo[shard::shards])}] {model} {config}: {status}', flush=True)
        with open(own + '.tmp', 'w') as f:
            json.dump(cache, f)
        os.replace(own + '.tmp', own)
    if args.shard is not None:
        return 0
    confirmed = confirmations()
    carried = not confirmed and os.path.exists(TABLE)  # no table's traces here (not committed): keep the page's marks
    if carried:
        confirmed = {(r['model'], table_kind(r['config'])): r['confirmed_by'] for r in csv.DictReader(open(TABLE))
                     if r['confirmed_by']}
    rows = []
    for model in models:
        for config in CONFIGS:
            if config not in traced:
                rows += [kept[(model, config)]] if (model, config) in kept else []
                continue
            entry = cache[f'{model}|{TRACED_AS.get(config, config)}']
            if config in OPTIONAL and 'error' in entry:
                continue
            size = entry.get('describe', '').split(' at input ')[-1].split(',')[0]
            rows.append(dict(model=model, input=size, config=config,
                             **{name: largest(entry, name, config) for name in ATLAS_CARDS},
                             # the published tables ran no checkpointing: they confirm the other steps only
                             confirmed_by='' if config in OPTIONAL else
                             confirmed.get((model, table_kind(config)), '')))
    with open(TABLE, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    seconds = [e['seconds'] for k, e in cache.items() if 'seconds' in e and k.split('|')[0] in models
               and k.split('|')[1] in traced]
    with open(DOC, 'w') as f:
        f.write(markdown(rows, sum(seconds), time.perf_counter() - started, sorted(traced) if kept else None,
                         carried))
    print(f'{DOC} and {TABLE} written ({len(rows)} rows)')
    return 0


def markdown(rows: List[dict], traced_s: float, run_s: float, only: Optional[List[str]] = None,
             carried: bool = False) -> str:
    """The page; `only`: the steps this run traced, the other rows kept from the run before; `carried`: the
    confirmations kept from the run before (no table's traces to judge them with)."""
    took = (f'The page took {traced_s / 60:.0f} min of tracing on 2 CPU cores (this run {run_s:.0f} s).' if only is None
            else f'The {", ".join(only)} rows took {traced_s / 60:.0f} min of tracing on 2 CPU cores (this run '
                 f'{run_s:.0f} s); the others are kept from the run before.')
    head = ['# What fits where', '', '<!-- flags: tune_batch.py validate.py bench/bench_atlas.py -->', '```bash',
            'python tune_batch.py --model resnet50 --amp --device cuda --gpu h100-80gb --estimate  # your own',
            'python validate.py --model resnet50 --amp --device cuda --gpu h100-80gb --estimate   # eval batch',
            'python bench/bench_atlas.py                                  # regenerate this page and what-fits.csv',
            '```', '',
            'The largest batch of timm\'s most used models on six cards, before you rent one: the training '
            'micro-batch of train.py\'s own step (AMP float16 or bfloat16, SGD with momentum or AdamW, one process, '
            'train.py\'s defaults, no headroom) and validate.py\'s eval batch (float16), at each model\'s default '
            'resolution. bfloat16 holds what float16 holds in this model (the same casts, two bytes an element), '
            'so its rows repeat float16\'s. `-` : not even batch 1 fits. Each figure is the CUDA memory estimate of '
            '`tune_batch.py --estimate --gpu NAME` (no GPU ran it): the card\'s memory as CUDA reports it, less the '
            'CUDA context ([docs/gpu.md](gpu.md#named-cards) lists each card\'s figures and sources). Where the '
            'model\'s figure is held by a kernel limit, not memory (a depthwise '
            'convolution reaching 2**31 elements, attention reaching 65535 windows), bigger cards do not raise it. '
            '`fp16 adamw ckpt` is `fp16 adamw` with `--grad-checkpointing` (activations recomputed in the backward '
            'pass; the savers table of `tune_batch.py --estimate` prices its extra compute), for the models whose '
            'checkpointed step the estimate traces: not yet ConvNeXt, Swin, MaxViT, CAFormer and EdgeNeXt (on the CUDA '
            'trace their recomputed forward\'s tensors differ from the first\'s, which torch\'s checkpoint refuses), '
            'nor inception_v3 (no checkpointing in timm).',
            '',
            '**Confirmed**: one of timm\'s published GPU tables holds this model, and the CUDA model, run as that '
            'table\'s software ran, lands inside the table\'s rung (`bench/bench_gpu_tables.py`, '
            '[docs/gpu.md](gpu.md)). Unmarked rows are predictions only.'
            + (' The marks are carried from the page\'s previous run: the tables\' traces were not in the checkout '
               'that wrote this one (run `bench/bench_gpu_tables.py` first to judge them again).' if carried else ''),
            '',
            f'{took} The same rows as CSV: [what-fits.csv](what-fits.csv).', '',
            '| model | input | step | ' + ' | '.join(ATLAS_CARDS) + ' | confirmed by |',
            '|---|---|---|' + '---:|' * len(ATLAS_CARDS) + '---|']
    body = []
    for r in rows:
        cells = ' | '.join('-' if not r[name] else str(r[name]) for name in ATLAS_CARDS)
        body.append(f"| {r['model']} | {r['input']} | {r['config']} | {cells} | {r['confirmed_by']} |")
    return '\n'.join(head + body) + '\n'


if __name__ == '__main__':
    sys.exit(main())
