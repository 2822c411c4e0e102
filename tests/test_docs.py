"""Docs that cannot go stale: the README's shape, every `--flag` the docs name, and the commands they mark runnable.

Which parser a flag is checked against: the scripts named on the same line (a command joined over its `\\`
continuations), else the page's own, declared by a `<!-- flags: SCRIPT ... -->` comment (it holds until the next
one). Text between `<!-- docs-test: skip ...` and `<!-- docs-test: end -->` is not checked (placeholders for flags that
do not exist yet). A fenced bash block right after `<!-- runnable -->` is run on generated data in a fresh folder.
"""
import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import pytest

from conftest import REPO_ROOT

README = REPO_ROOT / 'README.md'
DOCS = sorted((REPO_ROOT / 'docs').glob('*.md'))
README_SCRIPTS = ('train.py', 'tune_batch.py', 'validate.py')  # the README is about all three
SCRIPT = re.compile(r'(?<![\w.-])(train\.py|validate\.py|tune_batch\.py|distributed_train\.sh|torchrun|'
                    r'torch\.distributed\.run|bench/\w+\.(?:py|sh)|timm_ext\.synthetic_data|timm_ext\.packaged_data|'
                    r'prlimit)'
                    r'(?![\w.])')
FLAG = re.compile(r'(?<![\w-])--([A-Za-z][\w-]*)')
SCOPE = re.compile(r'<!--\s*flags:\s*([^>]*?)\s*-->')
SKIP, SKIP_END = '<!-- docs-test: skip', '<!-- docs-test: end -->'
RUNNABLE = '<!-- runnable -->'
QUOTED_OPTION = re.compile(r'''['"](--[A-Za-z][\w-]*)['"]''')


def _options(parser) -> FrozenSet[str]:
    return frozenset(option for action in parser._actions for option in action.option_strings)


def _source_options(path: Path) -> FrozenSet[str]:
    """The options a script without an importable parser declares: quoted in Python (and in bench/common.py when it
    builds on it), any `--word` in a shell script (its `case` patterns)."""
    text = path.read_text()
    if path.suffix == '.sh':
        return frozenset('--' + name for name in FLAG.findall(text))
    if path.parent.name == 'bench' and 'from common import' in text:
        text += (path.parent / 'common.py').read_text()
    return frozenset(QUOTED_OPTION.findall(text))


@functools.lru_cache(maxsize=None)
def flags_of(script: str) -> FrozenSet[str]:
    """Every option string of `script`'s parser: the scripts' own parser builders, torchrun's, else the source's."""
    if script in ('train.py', 'distributed_train.sh'):
        from timm_ext.train.args import build_parser
        return _options(build_parser())
    if script == 'validate.py':
        from timm_ext.validate.args import build_validate_parser
        return _options(build_validate_parser())
    if script == 'tune_batch.py':
        spec = importlib.util.spec_from_file_location('tune_batch_for_docs', REPO_ROOT / 'tune_batch.py')
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return _options(module.build_tune_parser())
    if script in ('torchrun', 'torch.distributed.run'):
        from torch.distributed.run import get_args_parser
        return _options(get_args_parser())
    if script == 'prlimit':  # util-linux: its options as its own help lists them
        help_text = subprocess.run(['prlimit', '--help'], capture_output=True, text=True, check=True).stdout
        return frozenset('--' + name for name in FLAG.findall(help_text))
    if script.startswith('timm_ext.'):
        return _source_options(REPO_ROOT / (script.replace('.', '/') + '.py'))
    path = REPO_ROOT / script
    if not path.is_file():
        raise FileNotFoundError(f'the docs name {script}, which is not in the repository')
    return _source_options(path)


def _logical_lines(text: str) -> List[Tuple[int, str, bool]]:
    """(line number, text, in a code block) with shell continuations joined and skipped regions left out."""
    lines, skipping, pending, start, code = [], False, '', 0, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(SKIP):
            skipping = True
        if skipping:
            skipping = SKIP_END not in line
            continue
        if line.startswith('```'):
            code = not code
            continue
        if not pending:
            start = number
        if line.rstrip().endswith('\\'):
            pending += line.rstrip()[:-1] + ' '
            continue
        lines.append((start, pending + line, code or line.startswith('    ')))
        pending = ''
    return lines


def unknown_flags(text: str, default_scripts: Sequence[str],
                  flags: Optional[Mapping[str, FrozenSet[str]]] = None) -> List[Tuple[int, str, Tuple[str, ...]]]:
    """The `--flags` of `text` that no parser of the scripts it is about has: (line, flag, scripts checked).

    A command (a line of a code block) is about the scripts it runs, else the scope's; a line of prose about the
    scripts it names and the scope's (prose names one script while it speaks of another's flags).

    Args:
        text: Markdown.
        default_scripts: The scripts a line that names none is about (until a `<!-- flags: ... -->` comment).
        flags: Option strings by script, in place of the real parsers' (the tests' own check removes one).
    """
    def lookup(script: str) -> FrozenSet[str]:
        return flags[script] if flags is not None and script in flags else flags_of(script)

    scripts, found = tuple(default_scripts), []
    for number, line, code in _logical_lines(text):
        scope = SCOPE.search(line)
        if scope:
            scripts = tuple(scope.group(1).split())
            continue
        named = tuple(dict.fromkeys(SCRIPT.findall(line)))
        named = (named or scripts) if code else tuple(dict.fromkeys(named + scripts))
        known = frozenset().union(*(lookup(script) for script in named))
        found += [(number, '--' + name, named) for name in FLAG.findall(line) if '--' + name not in known]
    return found


def _page_scripts(path: Path) -> Tuple[str, ...]:
    return README_SCRIPTS if path == README else ()


# ---- the README's shape and the pages it links ------------------------------------------------------------------

def test_readme_is_short_and_starts_with_the_two_commands_and_everyday_use():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    wide = [number for number, line in enumerate(lines, 1) if len(line) > 120]
    assert not wide, f'README lines wider than 120 columns: {wide}'
    first_block = lines[lines.index('```bash') + 1:lines.index('```bash') + 3]
    assert [line.split()[:2] for line in first_block] == [['bash', 'scripts/demo.sh'], ['bash', 'scripts/test.sh']]
    # the test command is the one CI runs
    assert 'bash scripts/test.sh' in (REPO_ROOT / '.ci' / 'run').read_text()
    headings = [line for line in lines if line.startswith('## ')]
    assert headings[0] == '## Everyday use'
    text = README.read_text()
    for command in ('./distributed_train.sh 8', 'python validate.py', '--retry', 'cp train.py validate.py',
                    'tune_batch.py', '--nproc 8'):
        assert command in text.split('## What differs')[0], command


def test_every_docs_page_is_linked_from_the_readme_and_starts_with_commands():
    text = README.read_text()
    assert DOCS, 'docs/ has no pages'
    for page in DOCS:
        assert f'(docs/{page.name})' in text, f'README does not link docs/{page.name}'
        body = [line for line in page.read_text().splitlines()[1:] if line.strip() and not line.startswith('<!--')]
        assert body[0].startswith('```'), f'docs/{page.name} does not start with its commands'
        assert SCOPE.search(page.read_text()), f'docs/{page.name} declares no <!-- flags: SCRIPT --> scope'


def _anchors(page: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    headings = re.findall(r'^#+ (.+)$', page.read_text(), flags=re.MULTILINE)
    return {re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-') for heading in headings}


def test_relative_links_point_at_files_and_headings():
    anchors = 0
    for page in [README, *DOCS]:
        for target, anchor in re.findall(r'\]\(([^)#:\s]*)(?:#([^)]*))?\)', page.read_text()):
            linked = (page.parent / target) if target else page
            assert linked.exists(), f'{page.name} links {target}, which does not exist'
            assert not anchor or anchor in _anchors(linked), f'{page.name} links {target}#{anchor}: no such heading'
            anchors += bool(anchor)
    assert anchors >= 5  # the README's figures link into docs/benchmarks.md


# ---- every named flag exists ------------------------------------------------------------------------------------

@pytest.mark.parametrize('page', [README, *DOCS], ids=lambda p: p.name)
def test_every_named_flag_exists_in_the_parser_of_its_script(page):
    problems = unknown_flags(page.read_text(), _page_scripts(page))
    assert not problems, '\n'.join(f'{page.name}:{n}: {flag} is not a flag of {" / ".join(s)}'
                                   for n, flag, s in problems)


def test_the_check_reports_a_flag_that_is_not_there():
    # a made-up flag, and a real flag of another script: both reported, a real one of the named script is not
    text = ('```bash\npython train.py --batch-ramp --no-such-flag\npython validate.py --retry\n'
            'python train.py --retry\n```\n')
    assert unknown_flags(text, ()) == [(2, '--no-such-flag', ('train.py',)), (4, '--retry', ('train.py',))]
    # prose: the named script and the scope's; a continued command is one line
    prose = ('train.py turns on --log-noise-scale, and validate.py has --retry\n'
             '```bash\npython train.py \\\n  --gone\n```\n')
    assert unknown_flags(prose, ('train.py',)) == [(3, '--gone', ('train.py',))]
    # the scope comment moves the default, and a skipped region is not read
    scoped = ('<!-- flags: validate.py -->\n--retry --epochs\n<!-- docs-test: skip -->\n--gone\n'
              '<!-- docs-test: end -->\n')
    assert unknown_flags(scoped, ('train.py',)) == [(2, '--epochs', ('validate.py',))]


def test_removing_a_flag_from_its_parser_fails_the_docs_that_name_it():
    page = REPO_ROOT / 'docs' / 'training.md'
    assert unknown_flags(page.read_text(), ()) == []
    removed = {script: flags_of(script) - {'--batch-ramp'} for script in ('train.py', 'tune_batch.py')}
    problems = unknown_flags(page.read_text(), (), removed)
    assert problems and {flag for _, flag, _ in problems} == {'--batch-ramp'}


# ---- the commands marked runnable -------------------------------------------------------------------------------

def runnable_blocks(text: str) -> List[str]:
    """The bash blocks right after a `<!-- runnable -->` line."""
    lines, blocks = text.splitlines(), []
    for index, line in enumerate(lines):
        if line.strip() != RUNNABLE:
            continue
        fence = index + 1
        assert lines[fence].startswith('```bash'), f'line {fence + 1}: {RUNNABLE} must come right before ```bash'
        end = lines.index('```', fence + 1)
        blocks.append('\n'.join(lines[fence + 1:end]))
    return blocks


RUNNABLE_BLOCKS = [(page.name, block) for page in [README, *DOCS] for block in runnable_blocks(page.read_text())]


def run_block(block: str, folder: Path) -> subprocess.CompletedProcess:
    """`block` in bash from `folder`, as a reader would run it in a checkout: `python` is this interpreter and the
    project's scripts are beside the commands."""
    for name in ('train.py', 'validate.py', 'tune_batch.py', 'distributed_train.sh'):
        link = folder / name
        if not link.exists():
            link.symlink_to(REPO_ROOT / name)
    env: Dict[str, str] = {**os.environ, 'PATH': f'{Path(sys.executable).parent}{os.pathsep}{os.environ["PATH"]}',
                           'PYTHONPATH': str(REPO_ROOT), 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1'}
    return subprocess.run(['bash', '-euo', 'pipefail', '-c', block], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=240)


def test_docs_mark_commands_runnable():
    assert {name for name, _ in RUNNABLE_BLOCKS} >= {'training.md', 'tuning.md', 'validation.md'}


@pytest.mark.parametrize('page,block', RUNNABLE_BLOCKS, ids=[name for name, _ in RUNNABLE_BLOCKS])
def test_runnable_commands_run_on_generated_data(page, block, tmp_path):
    result = run_block(block, tmp_path)
    assert result.returncode == 0, f'{page}:\n{block}\n{result.stderr[-3000:]}'


def test_a_runnable_block_with_a_flag_that_is_gone_fails(tmp_path):
    result = run_block('python train.py --data-dir data --no-such-flag', tmp_path)
    assert result.returncode == 2 and '--no-such-flag' in result.stderr
