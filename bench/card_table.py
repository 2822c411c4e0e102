"""docs/gpu.md's table of named cards, written from `timm_ext.memory_model.cards`, the table `--gpu` and the atlas read.

    python bench/card_table.py            # print the table
    python bench/card_table.py --write    # replace it in docs/gpu.md, between its `cards` markers

tests/test_card_docs.py fails when docs/gpu.md's table is not what this writes.
"""
import argparse
import os
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from timm_ext.memory_model.cards import CARDS, COMPUTE_CAPABILITY_SOURCE, CONTEXTS  # noqa: E402

DOC = os.path.join(ROOT, 'docs', 'gpu.md')
BEGIN, END = '<!-- cards: begin (bench/card_table.py --write) -->', '<!-- cards: end -->'
GiB = 1 << 30


def card_rows() -> List[str]:
    """The markdown table: one row a card, then one a CUDA context."""
    rows = ['| `--gpu` | card | memory as CUDA reports it | allocator may use | compute capability | source |',
            '| --- | --- | ---: | ---: | :---: | --- |']
    for card in CARDS.values():
        major, minor = card.compute_capability
        aliases = f' (also {", ".join(card.aliases)})' if card.aliases else ''
        note = f'; {card.note}' if card.note else ''
        rows.append(f'| `{card.name}`{aliases} | {card.title} | {card.reported_bytes / GiB:.2f} GiB | '
                    f'{card.allocator_bytes / GiB:.2f} GiB | {major}.{minor} | {card.reported_source}{note} |')
    rows += ['', f'Compute capabilities: {COMPUTE_CAPABILITY_SOURCE}. CUDA contexts (outside the caching allocator):',
             '', '| context | bytes | source | basis |', '| --- | ---: | --- | --- |']
    rows += [f'| {c.name} | {c.nbytes / GiB:.2f} GiB | {c.source} | {c.basis} |' for c in CONTEXTS.values()]
    return rows


def with_table(text: str) -> str:
    """`text` (docs/gpu.md) with the table between its markers replaced by `card_rows`."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + '\n' + '\n'.join(card_rows()) + '\n' + text[end:]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--write', action='store_true', help='replace the table in docs/gpu.md')
    args = parser.parse_args(argv)
    if not args.write:
        print('\n'.join(card_rows()))
        return 0
    with open(DOC) as f:
        text = f.read()
    with open(DOC, 'w') as f:
        f.write(with_table(text))
    print(f'{DOC}: {len(CARDS)} cards written')
    return 0


if __name__ == '__main__':
    sys.exit(main())
