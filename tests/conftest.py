"""Shared test fixtures: a tiny generated ImageFolder and helpers to run the project's scripts."""
import contextlib
import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from timm_ext.synthetic_data import make_image_folder
from timm_ext.tune.tuned_config import planned_command

REPO_ROOT = Path(__file__).resolve().parent.parent

# Two cores are shared by everything in a test run; one intra-op thread per process keeps runs predictable.
torch.set_num_threads(1)
os.environ.setdefault('OMP_NUM_THREADS', '1')


@pytest.fixture(scope='session')
def image_folder(tmp_path_factory) -> Path:
    """A tiny ImageFolder dataset: train/ and validation/, 3 classes, 8 images each, 32 px."""
    return make_image_folder(tmp_path_factory.mktemp('data'))


def run_script(script: str, *args: str, timeout: float = 300, env: dict | None = None,
               preexec_fn=None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run one of the project's scripts with this interpreter; returns the completed process (text output)."""
    full_env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1', **(env or {})}
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / script), *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO_ROOT,
        preexec_fn=preexec_fn,
    )


def train_in_process(*args: str) -> subprocess.CompletedProcess:
    """train.py's `main` on these arguments in this process, its output captured as `run_script` captures the
    script's: for tests of what a run does, not of the process boundary, without an interpreter start (about 5 s
    of importing torch and timm on two busy cores). Exit status from `main`'s return or from argparse's exit."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import train as train_script
    argv = list(map(str, args))
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = []  # main() adds its handler on the captured stderr, as the script does on its own
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = train_script.main(argv)
            except SystemExit as e:  # as the interpreter ends on it: a message goes to stderr, status 1
                code = e.code if isinstance(e.code, int) or e.code is None else 1
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
                code = code or 0
    finally:
        root.handlers = handlers
        root.setLevel(level)
    return subprocess.CompletedProcess(['train.py', *argv], code, out.getvalue(), err.getvalue())


def tuned_flags(config: Path) -> list:
    """The extension flags on the train command a tuned config records (after ``-c CONFIG``), as a user running that
    command passes them."""
    command = planned_command(Path(config).read_text())
    assert command is not None, f'{config} records no train command'
    return command[command.index('-c') + 2:]


def torchrun(*argv, cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a script on 2 local ranks (gloo on CPU) with torchrun's --standalone rendezvous (a free port of its own)."""
    full_env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO_ROOT), **(env or {})}
    return subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           *map(str, argv)], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env)
