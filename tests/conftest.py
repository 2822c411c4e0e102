"""Shared test fixtures: a tiny generated ImageFolder and helpers to run the project's scripts."""
import contextlib
import importlib.util
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


_SCRIPTS = {}


def script_in_process(script: str, *args: str) -> subprocess.CompletedProcess:
    """One of the project's scripts run by its `main` in this process, its output captured as `run_script` captures
    the script's: for tests of what a run does, not of the process boundary, without an interpreter start (about
    5 s of importing torch and timm on two busy cores). The exit status is `main`'s return or a `SystemExit`'s."""
    if script not in _SCRIPTS:
        spec = importlib.util.spec_from_file_location(f'_script_{Path(script).stem}', REPO_ROOT / script)
        _SCRIPTS[script] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_SCRIPTS[script])
    argv = list(map(str, args))
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level, argv0 = root.handlers[:], root.level, sys.argv[0]
    root.handlers = []  # main() adds its handler on the captured stderr, as the script does on its own
    sys.argv[0] = str(REPO_ROOT / script)  # argparse's prog, as in the script's process
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = _SCRIPTS[script].main(argv)
            except SystemExit as e:  # as the interpreter ends on it: a message goes to stderr, status 1
                code = e.code if isinstance(e.code, int) or e.code is None else 1
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
                code = code or 0
    finally:
        root.handlers = handlers
        root.setLevel(level)
        sys.argv[0] = argv0
    return subprocess.CompletedProcess([script, *argv], code, out.getvalue(), err.getvalue())


def train_in_process(*args: str) -> subprocess.CompletedProcess:
    """train.py's `main` on these arguments in this process (`script_in_process`)."""
    return script_in_process('train.py', *args)


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
