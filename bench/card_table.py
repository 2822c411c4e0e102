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

from timm_ext.memory_model.cards import CARDS, COMPUTE_CAPABILITY_SOURCE  # noqa: E402
from timm_ext.memory_model.contexts import (  # noqa: E402
    CONTEXT_MEASUREMENTS, MODULES_BYTES, MODULES_HIGH, MODULES_LOW, MODULES_SOURCE,
)
from timm_ext.memory_model.versions import RELEASES  # noqa: E402

DOC = os.path.join(ROOT, 'docs', 'gpu.md')
BEGIN, END = '<!-- cards: begin (bench/card_table.py --write) -->', '<!-- cards: end -->'
GiB = 1 << 30


def _gib(nbytes: int) -> str:
    return f'{nbytes / GiB:.2f} GiB'


def card_rows() -> List[str]:
    """The markdown tables: one row a card (its CUDA context under each covered release), then one a published
    measurement of the context."""
    releases = {f"torch {'.'.join(map(str, r.torch))} + CUDA {'.'.join(map(str, r.cuda))}": r for r in RELEASES}
    rows = ['| `--gpu` | card | memory as CUDA reports it | compute capability | CUDA context: '
            + ', '.join(releases) + ' | allocator may use (pinned release) | source |',
            '| --- | --- | ---: | :---: | ---: | ---: | --- |']
    for card in CARDS.values():
        major, minor = card.compute_capability
        aliases = f' (also {", ".join(card.aliases)})' if card.aliases else ''
        note = f'; {card.note}' if card.note else ''
        contexts = ', '.join(_gib(card.context(r).nbytes) + ('' if card.context(r).measured else ' (assumed)')
                             for r in releases.values())
        rows.append(f'| `{card.name}`{aliases} | {card.title} | {_gib(card.reported_bytes)} | {major}.{minor} | '
                    f'{contexts} | {_gib(card.allocator_bytes)} | {card.reported_source}{note} |')
    rows += ['', f'Compute capabilities: {COMPUTE_CAPABILITY_SOURCE}. A card\'s CUDA context (outside the caching '
             f'allocator) is the bare context published under the run\'s module loading for its torch and CUDA, else for '
             f'its generation, the largest within (`contexts.cuda_context`; "assumed": neither published, the largest '
             f'of any card taken), '
             f'plus {_gib(MODULES_BYTES)} of kernel modules a step loads after it ({MODULES_SOURCE}; seen from '
             f'{_gib(MODULES_LOW)}, up to an assumed {_gib(MODULES_HIGH)}). The published bare contexts:', '',
             '| module loading | bare context | compute capability | what was measured | source |',
             '| --- | ---: | :---: | --- | --- |']
    for m in CONTEXT_MEASUREMENTS:
        generation = '.'.join(map(str, m.compute_capability)) if m.compute_capability else 'not named'
        rows.append(f'| {m.loading} | {m.nbytes / (1 << 20):.0f} MiB | {generation} | {m.what} | {m.source} |')
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
