"""docs/what-fits.md and its CSV against a fresh estimate: the atlas says what today's code predicts."""
import csv
import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / 'bench'))
import bench_atlas  # noqa: E402

def fresh_trace(model: str, config: str) -> dict:
    """The atlas's trace in a fresh process: this one may have run threads that a forked trace cannot survive."""
    code = (f'import json, sys; sys.path.insert(0, {str(REPO_ROOT / "bench")!r}); import bench_atlas; '
            f'print(json.dumps(bench_atlas.trace({model!r}, {config!r})))')
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


ROWS = list(csv.DictReader((REPO_ROOT / 'docs' / 'what-fits.csv').open()))


def test_the_atlas_covers_its_models_steps_and_cards_and_is_linked_from_the_readme():
    assert {r['model'] for r in ROWS} == set(bench_atlas.MODELS)
    assert {r['config'] for r in ROWS} == set(bench_atlas.CONFIGS)
    assert all(name in ROWS[0] for name in bench_atlas.ATLAS_CARDS)  # the named cards (cards.py)
    assert 'docs/what-fits.md' in (REPO_ROOT / 'README.md').read_text()
    doc = (REPO_ROOT / 'docs' / 'what-fits.md').read_text()
    assert doc.count('\n| ') >= len(ROWS)  # every CSV row is a row of the page
    for row in (r for r in ROWS if r['config'] == 'fp16 adamw ckpt'):  # checkpointing never fits fewer samples
        plain = next(r for r in ROWS if r['model'] == row['model'] and r['config'] == 'fp16 adamw')
        assert all(int(row[name]) >= int(plain[name]) for name in bench_atlas.ATLAS_CARDS), row['model']


@pytest.mark.parametrize('model,config', [('resnet18', 'fp16 sgd'), ('vit_tiny_patch16_224', 'eval fp16')])
def test_atlas_rows_match_a_fresh_estimate(model, config):
    row = next(r for r in ROWS if r['model'] == model and r['config'] == config)
    entry = fresh_trace(model, config)
    for name in bench_atlas.ATLAS_CARDS:
        fresh, written = bench_atlas.largest(entry, name, config), int(row[name])
        assert fresh == pytest.approx(written, rel=0.01), (model, config, name)
    if config.startswith('fp16'):  # bfloat16's rows repeat float16's: a bfloat16 trace holds the same bytes
        twin = fresh_trace(model, config.replace('fp16', 'bf16'))
        assert [bench_atlas.largest(twin, name, config) for name in bench_atlas.ATLAS_CARDS] == [
            bench_atlas.largest(entry, name, config) for name in bench_atlas.ATLAS_CARDS]
    # more memory never fits fewer samples
    sizes = [int(row[name]) for name in bench_atlas.ATLAS_CARDS]
    assert sizes == sorted(sizes) and sizes[0] > 0
