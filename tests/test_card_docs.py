"""docs/gpu.md's table of named cards is the table `--gpu` reads (`timm_ext/memory_model/cards.py`)."""
import sys

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / 'bench'))
import card_table  # noqa: E402

from timm_ext.memory_model.cards import CARDS  # noqa: E402


def test_docs_gpu_lists_the_same_cards_with_the_same_figures():
    doc = (REPO_ROOT / 'docs' / 'gpu.md').read_text()
    assert doc == card_table.with_table(doc), 'docs/gpu.md: run python bench/card_table.py --write'
    listed = doc[doc.index(card_table.BEGIN):doc.index(card_table.END)]
    assert all(f'| `{name}`' in listed for name in CARDS)


def test_the_check_fails_when_a_card_is_missing_from_the_docs():
    doc = (REPO_ROOT / 'docs' / 'gpu.md').read_text()
    stale = '\n'.join(line for line in doc.splitlines() if not line.startswith('| `h200`')) + '\n'
    assert stale != card_table.with_table(stale)
