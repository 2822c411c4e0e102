"""Shared test fixtures: a tiny generated ImageFolder and a helper to run the project's scripts."""
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DIR = REPO_ROOT.parent / 'shared'

# Two cores are shared by everything in a test run; one intra-op thread per process keeps runs predictable.
torch.set_num_threads(1)
os.environ.setdefault('OMP_NUM_THREADS', '1')


def make_image_folder(root: Path, size: int = 32, per_class: int = 8, classes: Sequence[str] = ('circle', 'square', 'cross')):
    """Write train/ and validation/ splits of simple drawn shapes, one class folder per shape.

    The shapes differ in form (not only colour), so a model can learn them, and every image is distinct
    (position and colour vary with a seeded RNG), which keeps the files deterministic across runs.
    """
    from PIL import Image, ImageDraw
    import random

    rng = random.Random(0)
    for split in ('train', 'validation'):
        for cls in classes:
            folder = root / split / cls
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                img = Image.new('RGB', (size, size), tuple(rng.randrange(0, 80) for _ in range(3)))
                draw = ImageDraw.Draw(img)
                color = tuple(rng.randrange(150, 256) for _ in range(3))
                r = rng.randrange(size // 5, size // 3)
                cx, cy = rng.randrange(r, size - r), rng.randrange(r, size - r)
                if cls == 'circle':
                    draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=color)
                elif cls == 'square':
                    draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=color)
                else:
                    w = max(r // 3, 1)
                    draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=color)
                    draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=color)
                img.save(folder / f'{cls}_{i:03d}.png')
    return root


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
