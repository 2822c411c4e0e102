"""A tiny generated ImageFolder (drawn shapes) for demos, tests and benchmarks: no downloads needed.

    python -m timm_ext.synthetic_data OUT_DIR [--size 32] [--per-class 8]

writes OUT_DIR/train/<class>/*.png and OUT_DIR/validation/<class>/*.png, one class per shape.
"""
import argparse
import random
from pathlib import Path
from typing import Sequence

__all__ = ['SHAPES', 'make_image_folder']

SHAPES = ('circle', 'square', 'cross')


def make_image_folder(root, size: int = 32, per_class: int = 8, classes: Sequence[str] = SHAPES,
                      splits: Sequence[str] = ('train', 'validation')) -> Path:
    """Write `per_class` images of each shape in each split; returns `root`.

    Shapes differ in form, not only colour, so a model can learn them; position, size and colours vary with a
    seeded RNG, so every image differs and every run writes the same files.
    """
    from PIL import Image, ImageDraw

    if size < 8 or per_class < 1:
        raise ValueError(f'size must be >= 8 and per_class >= 1, got size={size}, per_class={per_class}')
    root = Path(root)
    rng = random.Random(0)
    for split in splits:
        for index, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                img = Image.new('RGB', (size, size), tuple(rng.randrange(0, 80) for _ in range(3)))
                draw = ImageDraw.Draw(img)
                color = tuple(rng.randrange(150, 256) for _ in range(3))
                r = rng.randrange(size // 5, size // 3)
                cx, cy = rng.randrange(r, size - r), rng.randrange(r, size - r)
                shape = SHAPES[index % len(SHAPES)]
                if shape == 'circle':
                    draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=color)
                elif shape == 'square':
                    draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=color)
                else:
                    w = max(r // 3, 1)
                    draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=color)
                    draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=color)
                img.save(folder / f'{name}_{i:04d}.png')
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description='Write a tiny ImageFolder of drawn shapes (train/ and validation/).')
    parser.add_argument('out_dir', help='folder to create (train/ and validation/ go inside)')
    parser.add_argument('--size', type=int, default=32, help='image side in pixels (default: 32)')
    parser.add_argument('--per-class', type=int, default=8, help='images per class per split (default: 8)')
    parser.add_argument('--classes', type=int, default=3, help='number of classes (default: 3)')
    args = parser.parse_args()
    if args.classes < 1:
        parser.error(f'--classes must be >= 1, got {args.classes}')
    names = [f'{SHAPES[i % len(SHAPES)]}{i // len(SHAPES) or ""}' for i in range(args.classes)]
    try:
        make_image_folder(args.out_dir, args.size, args.per_class, names)
    except ValueError as exc:
        parser.error(str(exc))
    print(f'wrote {args.classes} classes x {args.per_class} images x 2 splits to {args.out_dir}')


if __name__ == '__main__':
    main()
