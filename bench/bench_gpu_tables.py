"""The CUDA memory estimate against timm's published GPU tables: does the predicted largest batch land in its rung?

    python bench/bench_gpu_tables.py                  # every row of bench/gpu_tables.csv (traces cached)
    python bench/bench_gpu_tables.py --table train    # one kind of table: train, infer (eager) or compiled
    python bench/bench_gpu_tables.py --select-rows /path/to/pytorch-image-models   # rewrite the data file

timm's `benchmark.py` starts each model at one batch (512 for training, 1024 or 2048 for inference) and after an
out-of-memory steps down `timm.utils.decay_batch_step` (512, 384, 256, 192, ...). A row recorded below the start
says: this rung fits the card and the next rung up did not. The estimate hits when its largest batch on that card
lies in [rung, next rung). A row at the start is a lower bound only (reported apart: the estimate should reach it).

Each table is replayed with its own software (`Table.software`, one of `timm_ext.memory_model.versions.RELEASES`,
as `--software` plans it): every versioned rule of the model (kernel routing and limits, attention backends,
workspaces, allocator options, autocast lists, the CUDA context) is that release's. What the benchmark itself did:
* train, RTX 3090 (torch 1.12.1, CUDA 11.3, cuDNN 8.3.2): AMP float16, SGD (momentum 0.9, nesterov),
  CrossEntropyLoss; `zero_grad()` kept the gradients allocated (torch 1.12's default), so every update runs with them
  resident; torch 1.12 had no scaled_dot_product_attention, so timm's attention ran unfused.
* infer, RTX 5090 and RTX Pro 6000 Max-Q (torch 2.9.1, CUDA 13.0, cuDNN 9.13.0): AMP float16, `inference_mode`, a
  forward with the weights alone resident (validate.py's estimate), fused attention.
* compiled (timm's `*-dynamo.csv`: the same forward under `torch.compile`, inductor): estimated with `--torchcompile`,
  which traces the compiled graphs as inductor runs them (`timm_ext.memory_model.compiled_step`); the Pro 6000's
  bfloat16-autocast table with `--amp-dtype bfloat16`. The RTX 5090 and RTX Pro 6000 tables may calibrate the model
  (issue 40); the RTX 4090's (torch 2.9.1, CUDA 12.8) only judges it.

The cards are tune_batch.py's named cards (`timm_ext.memory_model.cards`: rtx3090, rtx4090, rtx5090,
rtx-pro-6000-max-q): their memory as CUDA reports it and their compute capability, each with its source. Traces are
cached in bench/results/ by step, torch release, model and size (`Table.trace_key`: the tables of one torch on
several cards share them); `--fresh` traces again, `--shard 0/2` and `--shard 1/2` in two processes trace half each.
Nothing is fitted here. The cuDNN convolution workspace is a stated assumption (the input's bytes), so each table is
also scored with half and with twice it (`WORKSPACE_SCALES`). `--write-headroom` measures the default headroom of
tune_batch.py's and validate.py's CUDA plans from the calibration tables and writes it where the plans read it
(`timm_ext.memory_model.headroom`).
"""
import argparse
import csv
import json
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'bench'))
from timm_ext.memory_model.cards import CARDS  # noqa: E402
from timm_ext.memory_model.versions import Software, parse_software  # noqa: E402

DATA = os.path.join(ROOT, 'bench', 'gpu_tables.csv')
CACHE_DIR = os.path.join(ROOT, 'bench', 'results')
CACHE_NAME = 'gpu_tables_traces'  # one JSON file a shard: <name>.<i>of<n>.json


@dataclass(frozen=True)
class Table:
    """One published table and the software it ran.

    Attributes:
        kind: 'train' (an update) or 'infer' (a forward).
        start: The batch `benchmark.py` started at (a row there is a lower bound only).
        card: The card as the report names it.
        card_name: Its name in `timm_ext.memory_model.cards`.
        software: The torch, CUDA and cuDNN it ran (`timm_ext.memory_model.versions.RELEASES`).
        compiled: A dynamo table: the model ran under `torch.compile` (inductor); estimated with `--torchcompile`.
        amp_dtype: The autocast dtype.
        calibrates: The issue lets the model be calibrated on it (False: the table only judges).
    """
    kind: str
    start: int
    card: str
    card_name: str
    software: Software
    compiled: bool = False
    amp_dtype: str = 'float16'
    calibrates: bool = True

    @property
    def group(self) -> str:
        """What `--table` selects it by: 'train', 'infer' (eager) or 'compiled'."""
        return 'compiled' if self.compiled else self.kind

    @property
    def reported_bytes(self) -> int:
        return CARDS[self.card_name].reported_bytes

    @property
    def compute_capability(self) -> Tuple[int, int]:
        return CARDS[self.card_name].compute_capability

    @property
    def software_spec(self) -> str:
        """The table's software as `--software` names it."""
        torch, cuda, cudnn = ('.'.join(map(str, v)) for v in (self.software.torch, self.software.cuda,
                                                               self.software.cudnn))
        return f'torch={torch},cuda={cuda},cudnn={cudnn}'

    def trace_key(self, model: str, img_size: int) -> str:
        """The cache's key: the step and the torch release decide the trace (its autocast lists and whether
        attention is fused), so eager tables of one torch on several cards share it. A compiled trace's graphs are
        generated for a card (`timm_ext.memory_model.fake_cuda`): for the first table's card of the same compute
        capability, so the RTX Pro 6000's rows replay the RTX 5090's graphs (both 12.0; the multiprocessor count,
        188 against 170, only sizes split reductions' partial buffers), which halves the compiled traces."""
        step = self.kind + ('+compile' if self.compiled else '') + \
            (f'+{self.amp_dtype}' if self.amp_dtype != 'float16' else '')
        card = next(f'/{t.card_name}' for t in TABLES.values()
                    if t.compute_capability == self.compute_capability) if self.compiled else ''
        return f"{step}@{'.'.join(map(str, self.software.torch))}{card}:{model}:{img_size}"


_5090, _PRO6000 = 'RTX 5090 32 GB', 'RTX Pro 6000 Max-Q 96 GB'
# the software in each table's file name (pt112-cu113, pt291-cu130, pt291-cu128), with the cuDNN those wheels shipped
PT112_CU113 = parse_software('torch=1.12.1,cuda=11.3')
PT291_CU130 = parse_software('torch=2.9.1,cuda=13.0')
PT291_CU128 = parse_software('torch=2.9.1,cuda=12.8')
TABLES = {  # source file -> the table
    'benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv': Table('train', 512, 'RTX 3090 24 GB', 'rtx3090',
                                                              PT112_CU113),
    'benchmark-infer-amp-nchw-pt291-cu130-5090.csv': Table('infer', 1024, _5090, 'rtx5090', PT291_CU130),
    'benchmark-infer-amp-nchw-pt291-cu130-pro6000maxq.csv': Table('infer', 2048, _PRO6000, 'rtx-pro-6000-max-q',
                                                                  PT291_CU130),
    'benchmark-infer-amp-nchw-pt291-cu130-5090-dynamo.csv': Table('infer', 1024, _5090, 'rtx5090', PT291_CU130,
                                                                  compiled=True),
    'benchmark-infer-amp-nchw-pt291-cu130-pro6000maxq-dynamo.csv': Table('infer', 2048, _PRO6000,
                                                                         'rtx-pro-6000-max-q', PT291_CU130,
                                                                         compiled=True),
    'benchmark-infer-amp_bf16-nchw-pt291-cu130-pro6000maxq-dynamo.csv': Table(
        'infer', 2048, _PRO6000, 'rtx-pro-6000-max-q', PT291_CU130, compiled=True, amp_dtype='bfloat16'),
    # the judge: nothing is calibrated on it
    'benchmark-infer-amp-nchw-pt291-cu128-4090-dynamo.csv': Table('infer', 1024, 'RTX 4090 24 GB', 'rtx4090',
                                                                  PT291_CU128, compiled=True, calibrates=False),
}
WORKSPACE_SCALES = (0.5, 2.0)  # the cuDNN convolution workspace's weight: each table scored with it halved and doubled
TRAIN_FLAGS = ('--amp', '--opt', 'sgd', '--momentum', '0.9', '--lr', '1e-4', '--smoothing', '0', '--no-prefetcher')
INFER_FLAGS = ('--amp', '--no-prefetcher')
ROWS_PER_FAMILY = {'train': 1, 'infer': 2}  # training traces cost four updates each
SECOND_TRAIN_ROWS = 30  # families that give the training table a second row (their median model)
LOWER_BOUND_ROWS = 12  # rows at the start value kept per eager table (lower bounds)
COMPILED_BOUND_ROWS = 4  # the same, shared by the compiled tables
BFLOAT16_MAX_PARAMS_M = 50  # the bfloat16 compiled table's rows: small models (a compiled trace grows with the depth)
MAX_PARAMS_M = 400  # larger models take minutes to build for real before the trace


def family(model: str) -> str:
    """A model's family: its name's leading letters, weight-source prefixes dropped (tf_efficientnet: efficientnet)."""
    name = re.sub(r'^(tf_|tv_|gluon_|legacy_|ig_|ssl_|swsl_|timm_)', '', model)
    return re.match(r'[a-z]+', name).group(0)


def read_table(repo: str, source: str, known: set) -> List[dict]:
    """A published table's rows from a timm checkout (models this timm knows, up to `MAX_PARAMS_M`), each with the
    rung above its batch (`next_rung`, '' for a row at the start value)."""
    import subprocess
    from timm.utils import decay_batch_step
    table = TABLES[source]
    text = subprocess.run(['git', '-C', repo, 'show', f'HEAD:results/{source}'], capture_output=True, text=True,
                          check=True).stdout
    rows = []
    for r in csv.DictReader(text.splitlines()):
        if r['model'] not in known or float(r['param_count']) > MAX_PARAMS_M:
            continue
        batch = int(r[f'{table.kind}_batch_size'])
        upper = table.start
        while batch < table.start and decay_batch_step(upper) > batch:
            upper = decay_batch_step(upper)
        rows.append(dict(source=source, model=r['model'], img_size=int(r[f'{table.kind}_img_size']), batch=batch,
                         next_rung=upper if batch < table.start else '', params_m=float(r['param_count'])))
    return rows


def largest_per_family(rows: List[dict], limit: int) -> List[dict]:
    """Up to `limit` rows, the largest model of as many families (the largest come nearest a lower bound)."""
    chosen, seen = [], set()
    for r in sorted(rows, key=lambda r: r['params_m'], reverse=True):
        if family(r['model']) not in seen and len(seen) < limit:
            seen.add(family(r['model']))
            chosen.append(r)
    return chosen


def select_rows(repo: str, groups: Sequence[str]) -> List[dict]:
    """Pick the data file's rows of the eager tables in `groups` from a timm checkout: per table and family, the
    smallest model the decay reached and for inference (and `SECOND_TRAIN_ROWS` training families) the median one,
    every decayed row of the atlas's models (`bench_atlas.MODELS`), and a few rows at the start value; the compiled
    tables' rows as `select_compiled_rows` picks them."""
    import timm
    from atlas_models import MODELS as ATLAS_MODELS
    known = set(timm.list_models())
    chosen = []
    for source, table in TABLES.items():
        if table.group not in groups or table.compiled:
            continue
        rows = read_table(repo, source, known)
        decayed = defaultdict(list)
        for r in rows:
            if r['next_rung']:
                decayed[family(r['model'])].append(r)
        for n, rows_of_family in enumerate(decayed[f] for f in sorted(decayed)):
            rows_of_family.sort(key=lambda r: r['params_m'])
            second = ROWS_PER_FAMILY[table.kind] > 1 or n < SECOND_TRAIN_ROWS
            picks = {0, len(rows_of_family) // 2} if second else {0}
            picks |= {i for i, r in enumerate(rows_of_family) if r['model'] in ATLAS_MODELS}
            chosen += [rows_of_family[i] for i in sorted(picks)]
        chosen += largest_per_family([r for r in rows if not r['next_rung']], LOWER_BOUND_ROWS)
    return chosen + (select_compiled_rows(repo, known) if 'compiled' in groups else [])


def select_compiled_rows(repo: str, known: set) -> List[dict]:
    """The compiled tables' rows, picked so that the float16 tables share their traces (a compiled trace costs
    several times an eager one): per family, the smallest and the median model of the rows the decay reached on
    every float16 card, and `COMPILED_BOUND_ROWS` rows at the start value on every one; the bfloat16 table, whose
    batches are float16's on all but a few rows, the smallest per family up to `BFLOAT16_MAX_PARAMS_M` (traces of
    their own)."""
    tables = {source: {(r['model'], r['img_size']): r for r in read_table(repo, source, known)}
              for source, table in TABLES.items() if table.compiled}
    float16 = [source for source in tables if TABLES[source].amp_dtype == 'float16']
    decayed = set.intersection(*({k for k, r in tables[s].items() if r['next_rung']} for s in float16))
    at_start = set.intersection(*({k for k, r in tables[s].items() if not r['next_rung']} for s in float16))
    families = defaultdict(list)
    for key in sorted(decayed, key=lambda k: tables[float16[0]][k]['params_m']):
        families[family(key[0])].append(key)
    smallest = [keys[0] for keys in families.values()]
    medians = [keys[len(keys) // 2] for keys in families.values() if len(keys) > 1]
    bounds = [(r['model'], r['img_size']) for r in
              largest_per_family([tables[float16[0]][k] for k in at_start], COMPILED_BOUND_ROWS)]
    small = [k for k in smallest if tables[float16[0]][k]['params_m'] <= BFLOAT16_MAX_PARAMS_M]
    chosen = []
    for source, rows in tables.items():
        keys = smallest + medians + bounds if source in float16 else small
        chosen += [rows[k] for k in sorted(set(keys)) if k in rows]
    return chosen


def write_rows(rows: List[dict]) -> None:
    with open(DATA, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=['source', 'model', 'img_size', 'batch', 'next_rung', 'params_m'])
        writer.writeheader()
        writer.writerows(rows)


def read_rows() -> List[dict]:
    with open(DATA) as f:
        return [dict(r, img_size=int(r['img_size']), batch=int(r['batch']),
                     next_rung=int(r['next_rung']) if r['next_rung'] else None) for r in csv.DictReader(f)]


def read_cache() -> Dict[str, dict]:
    """Every shard's traces, those of an older trace format left out (no event log recorded)."""
    cache = {}
    for name in sorted(os.listdir(CACHE_DIR)) if os.path.isdir(CACHE_DIR) else ():
        if name.startswith(CACHE_NAME) and name.endswith('.json'):
            with open(os.path.join(CACHE_DIR, name)) as f:
                cache.update({k: v for k, v in json.load(f).items() if 'error' in v or 'log' in v})
    return cache


def trace(key: str) -> dict:
    """One estimate as the table's software ran it (the step, torch release and row named by `Table.trace_key`'s
    key); a dict for the cache."""
    from timm_ext.memory_model.estimate import EstimateError, estimate_memory
    from timm_ext.train.args import parse_args
    step, model, img_size = key.split(':')
    step, release = step.split('@')
    torch_release, _, card = release.partition('/')
    kind, *options = step.split('+')
    flags = [*(TRAIN_FLAGS if kind == 'train' else INFER_FLAGS), *(['--torchcompile'] if 'compile' in options else []),
             *(['--amp-dtype', 'bfloat16'] if 'bfloat16' in options else [])]
    args, _ = parse_args(['--model', model, '--img-size', img_size, '--device', 'cuda', '--num-classes', '1000',
                          *flags])
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    args.gpu = card or None  # a compiled trace's graphs are generated for the table's card
    args.software = f'torch={torch_release}'  # the trace follows that release: its autocast lists, its attention
    try:
        e = estimate_memory(args, 'cuda', step_kind='train' if kind == 'train' else 'validate')
    except EstimateError as error:
        return dict(error=str(error))
    return e.to_json()


def to_estimate(entry: dict, table: Table, workspace_scale: float = 1.0):
    """A cached trace as the estimate for its table's software and card (see the module doc), the cuDNN convolution
    workspace scaled by `workspace_scale`."""
    from timm_ext.memory_model.replay import ReplayConfig
    from timm_ext.memory_model.devices import device_model
    from timm_ext.memory_model.estimate import MemoryEstimate
    config = ReplayConfig(compute_capability=table.compute_capability, software=table.software,
                          cudnn_workspace_scale=workspace_scale)
    return MemoryEstimate.from_json(entry, device_model('cuda', card=CARDS[table.card_name], software=table.software),
                                    config)


def predicted(entry: dict, source: str, headroom: float = 0.0) -> int:
    """The largest batch the estimate puts on the table's card, within `headroom` of its usable memory."""
    return largest(to_estimate(entry, TABLES[source]), TABLES[source], headroom)


def usable_bytes(table: Table) -> int:
    """What the caching allocator had on the table's card: its memory less the CUDA context of its software."""
    return CARDS[table.card_name].allocator_bytes_for(table.software)


def largest(estimate, table: Table, headroom: float = 0.0) -> int:
    # the training benchmark's zero_grad() keeps the gradients: every update starts with them resident
    return estimate.largest_batch(usable_bytes(table) * (1 - headroom), accumulating=table.kind == 'train')


def plan_headroom(kind: str) -> float:
    """The default headroom of the CUDA plan a user of that table would run: validate.py's for inference,
    tune_batch.py's for training (`timm_ext.memory_model.headroom`)."""
    from timm_ext.memory_model.headroom import estimate_headroom
    return estimate_headroom('validate' if kind == 'infer' else 'train').fraction


def headroom_needed(estimate, row: dict, table: Table) -> float:
    """The least headroom at which the plan for a decayed row stays below the rung that ran out of memory (0 where
    the model already does, or a kernel limit stops it)."""
    limit = estimate.launch_limit[0]
    if limit is not None and limit < row['next_rung']:
        return 0.0
    return max(0.0, 1.0 - estimate.peak(row['next_rung'], accumulating=table.kind == 'train') / usable_bytes(table))


def miss_reason(estimate, batch: int, accumulating: bool) -> str:
    """What holds a missed row's prediction: a kernel limit, or the share of the peak that the replay adds to the
    live bytes at the predicted batch (free blocks in segments, CUDA's workspaces)."""
    limit, why = estimate.launch_limit
    if limit is not None and batch >= limit:
        return f'kernel limit: {why}'
    split = estimate.categories(max(1, batch), accumulating)
    total = sum(split.values()) or 1.0
    return f"allocator and kernels {split.get('segments', 0) / total:.0%} of the peak"


def judge(table: Table, rows: List[dict], cache: Dict[str, dict],
          workspace_scale: float = 1.0) -> Tuple[List[tuple], List[str]]:
    """(row, estimate, predicted batch) of every traced row of a table, and the decayed rows not traced."""
    judged, failed = [], []
    for r in rows:
        entry = cache.get(table.trace_key(r['model'], r['img_size']))
        if entry is None or 'error' in entry:
            failed += [r['model']] if r['next_rung'] else []
            continue
        estimate = to_estimate(entry, table, workspace_scale)
        judged.append((r, estimate, largest(estimate, table)))
    return judged, failed


def within_rung(judged: List[tuple]) -> Tuple[int, int]:
    """(decayed rows whose prediction lies in their rung, decayed rows)."""
    decayed = [(r, b) for r, _, b in judged if r['next_rung']]
    return sum(r['batch'] <= b < r['next_rung'] for r, b in decayed), len(decayed)


def workspace_lines(table: Table, rows: List[dict], cache: Dict[str, dict]) -> List[str]:
    """What the table scores with the cuDNN convolution workspace (a stated assumption) halved and doubled."""
    scores = []
    for scale in WORKSPACE_SCALES:
        hits, n = within_rung(judge(table, rows, cache, scale)[0])
        scores.append(f'x{scale:g}: {hits} of {n} ({hits / max(1, n):.0%})')
    return [f"The cuDNN convolution workspace (assumed: the convolution's input) scaled: within the rung "
            f"{'; '.join(scores)}.", '']


def table_report(source: str, table: Table, rows: List[dict], cache: Dict[str, dict]) -> List[str]:
    """One table's section: its decayed rows within the rung, the default plan above it, the misses, the bounds."""
    headroom = plan_headroom(table.kind)
    judged, failed = judge(table, rows, cache)
    decayed = [(r, e, b) for r, e, b in judged if r['next_rung']]
    over = [f"{r['model']}@{r['img_size']}" for r, e, _ in decayed if largest(e, table, headroom) >= r['next_rung']]
    hits, misses = 0, defaultdict(list)
    for r, estimate, b in decayed:
        if r['batch'] <= b < r['next_rung']:
            hits += 1
            continue
        size = b / r['batch'] - 1 if b < r['batch'] else b / r['next_rung'] - 1
        reason = miss_reason(estimate, b, table.kind == 'train')
        misses[family(r['model'])].append(f"{r['model']}@{r['img_size']} {b} ({size:+.0%}; "
                                          f"rung {r['batch']}-{r['next_rung'] - 1}; {reason})")
    n, families = len(decayed), len({family(r['model']) for r in rows if r['next_rung']})
    tool = 'validate.py' if table.kind == 'infer' else 'tune_batch.py'
    software = ('torch.compile' if table.compiled else 'eager') + f', {table.amp_dtype} autocast'
    role = 'calibration' if table.calibrates else 'judge only (nothing calibrated on it)'
    lines = [f'## {table.card}, {software}: {source}', '', f'Role: {role}. Replayed with {table.software}.', '',
             f'Decayed rows: {n + len(failed)} across {families} families; estimated {n}; within the rung '
             f'{hits} of {n} ({hits / max(1, n):.0%}).', '',
             f"{tool}'s plan at its default headroom ({headroom:.0%}) above the rung (an out-of-memory or a failed "
             f"launch on this card): {len(over)} of {n} ({len(over) / max(1, n):.1%})"
             + (f": {', '.join(over)}." if over else '.'), '']
    if misses:
        lines += ['| family | misses: model@size, predicted (how far outside the rung; the rung; what holds it) |',
                  '|---|---|']
        lines += [f'| {fam} | {"; ".join(items)} |' for fam, items in sorted(misses.items())]
        lines.append('')
    if failed:
        lines += [f'Not traced ({len(failed)}): {", ".join(failed)}.', '']
    lines += limit_lines(judged) + ([] if table.compiled else workspace_lines(table, rows, cache))
    low = [(r, b) for r, _, b in judged if not r['next_rung']]
    reached = sum(b >= r['batch'] for r, b in low)
    return lines + [f'Lower bounds (rows at the start value {table.start}): the estimate reaches {reached} of '
                    f'{len(low)}' + (': below it ' + ', '.join(f"{r['model']}@{r['img_size']} {b}" for r, b in low
                                                            if b < r['batch']) if reached < len(low) else '') + '.', '']


def limit_lines(judged: List[tuple]) -> List[str]:
    """The kernel launch limits of the table's release (`MemoryEstimate.launch_limit`) against its (row, estimate,
    predicted batch): the rows whose prediction a limit holds, those of them within the rung, and every row a limit
    caps below the batch the table ran (a wrong limit)."""
    held, in_rung, wrong = 0, 0, []
    for r, estimate, b in judged:
        cap = estimate.launch_limit[0]
        if cap is None:
            continue
        held += b == cap
        in_rung += b == cap and r['batch'] <= cap < (r['next_rung'] or cap + 1)
        if cap < r['batch']:
            wrong.append(f"{r['model']}@{r['img_size']} {cap} (ran {r['batch']})")
    return [f'Kernel launch limits of this release hold the prediction of {held} rows, {in_rung} of them within the '
            f'rung; they cap {len(wrong)} of {len(judged)} rows below the batch the table ran'
            + (f": {', '.join(wrong)}." if wrong else '.'), '']


def measure_headroom(rows: List[dict], cache: Dict[str, dict]) -> dict:
    """The default headroom of each step's CUDA plan: per calibration table (eager), the least headroom that keeps
    `QUANTILE` of its decayed rows' plans below the rung that failed (`headroom_needed`); the largest over the tables
    of the step (tune_batch.py's 'train': the training table; validate.py's 'validate': the inference tables)."""
    from timm_ext.memory_model.headroom import QUANTILE
    measured = {}
    for step, kind in (('train', 'train'), ('validate', 'infer')):
        tables, fractions = [], []
        for source, table in TABLES.items():
            if table.kind != kind or table.compiled or not table.calibrates:
                continue
            judged, _ = judge(table, [r for r in rows if r['source'] == source and r['next_rung']], cache)
            needs = sorted(headroom_needed(e, r, table) for r, e, _ in judged)
            if not needs:
                continue
            at = needs[min(len(needs) - 1, int(QUANTILE * len(needs)))]
            fractions.append(at)
            tables.append(dict(name=f'{table.card} ({source})', rows=len(needs), fraction=round(at, 4)))
        if fractions:
            fraction = -(-max(fractions) * 200 // 1) / 200  # up to the next half percent
            measured[step] = dict(fraction=fraction, quantile=QUANTILE, tables=tables,
                                  measured_by='bench/bench_gpu_tables.py --write-headroom')
    return measured


def write_headroom(measured: dict) -> None:
    """Each step measured here replaces its entry of the headroom file (the others are kept)."""
    from timm_ext.memory_model import headroom
    with open(headroom.HEADROOM_FILE) as f:
        measured = {**json.load(f), **measured}
    with open(headroom.HEADROOM_FILE + '.tmp', 'w') as f:
        json.dump(measured, f, indent=1)
        f.write('\n')
    os.replace(headroom.HEADROOM_FILE + '.tmp', headroom.HEADROOM_FILE)
    headroom._measured.cache_clear()


def report(rows: List[dict], cache: Dict[str, dict], seconds: float) -> List[str]:
    lines = []
    for source, table in TABLES.items():
        mine = [r for r in rows if r['source'] == source]
        if mine:
            lines += table_report(source, table, mine, cache)
    keys = {TABLES[r['source']].trace_key(r['model'], r['img_size']) for r in rows}
    traced = [cache[k]['seconds'] for k in keys if 'seconds' in cache.get(k, {})]
    median = sorted(traced)[len(traced) // 2] if traced else 0.0
    lines.append(f'Traces: {len(traced)}, {sum(traced):.0f} s of tracing in all (median {median:.1f} s); this run '
                 f'{seconds:.0f} s.')
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--table', choices=('train', 'infer', 'compiled'), default=None,
                        help="only these tables: 'train', 'infer' (eager) or 'compiled' (timm's dynamo tables)")
    parser.add_argument('--fresh', action='store_true', help='trace again even where a cached trace exists')
    parser.add_argument('--select-rows', metavar='TIMM_REPO', default=None,
                        help="rewrite bench/gpu_tables.csv's rows of the tables (of --table's, the others kept) from "
                             "a timm checkout, then stop")
    parser.add_argument('--shard', default='0/1', metavar='I/N', help='trace only every N-th trace from the I-th')
    parser.add_argument('--report-only', action='store_true',
                        help='trace nothing: the report of what the cache holds (a row without a trace is not traced)')
    parser.add_argument('--output', default=os.path.join(ROOT, 'bench', 'results', 'gpu_tables.md'))
    parser.add_argument('--write-headroom', action='store_true',
                        help="measure the default headroom of the CUDA plans on the calibration tables and write it "
                             "to timm_ext/memory_model/headroom.json (needs the train and infer tables traced)")
    args = parser.parse_args(argv)
    groups = (args.table,) if args.table else ('train', 'infer', 'compiled')
    if args.select_rows:
        kept = [r for r in read_rows() if TABLES[r['source']].group not in groups]
        rows = select_rows(args.select_rows, groups)
        write_rows(kept + rows)
        print(f'{len(rows)} rows written to {DATA} ({len(kept)} of other tables kept)')
        return 0
    started = time.perf_counter()
    rows = [r for r in read_rows() if TABLES[r['source']].group in groups]
    shard, shards = map(int, args.shard.split('/'))
    own = os.path.join(CACHE_DIR, f'{CACHE_NAME}.{shard}of{shards}.json')
    cache = {} if args.fresh else read_cache()
    # the calibration tables' traces first: a run cut short still scores them
    calibrating = {TABLES[r['source']].trace_key(r['model'], r['img_size']): TABLES[r['source']].calibrates
                   for r in rows}
    keys = sorted(calibrating, key=lambda k: (not calibrating[k], k))
    todo = [] if args.report_only else [k for i, k in enumerate(keys) if i % shards == shard and k not in cache]
    mine = {} if args.fresh or not os.path.exists(own) else json.load(open(own))
    os.makedirs(CACHE_DIR, exist_ok=True)
    for i, key in enumerate(todo, 1):
        mine[key] = trace(key)
        status = mine[key].get('error') or f"{mine[key]['seconds']:.1f} s"
        print(f'[{i}/{len(todo)}] {key}: {status}', flush=True)
        with open(own + '.tmp', 'w') as f:
            json.dump(mine, f)
        os.replace(own + '.tmp', own)
    cache = read_cache()
    if args.write_headroom:
        measured = measure_headroom(rows, cache)
        write_headroom(measured)
        print('headroom written: ' + ', '.join(f"{step} {m['fraction']:.1%}" for step, m in measured.items()))
    lines = report(rows, cache, time.perf_counter() - started)
    with open(args.output, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))
    return 0


if __name__ == '__main__':
    sys.exit(main())
