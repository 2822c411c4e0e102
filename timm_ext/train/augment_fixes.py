"""Narrow fixes of timm's augmentation for the libraries it runs on today.

Posterize with 0 bits. timm's 'PosterizeIncreasing' op (RandAugment policies with `inc1`, e.g. the AugMix/JSD
recipe `--aa rand-m9-mstd0.5-inc1`) maps the top magnitude 10 to 4 - 4 = 0 bits kept, and passes that to
`PIL.ImageOps.posterize`. Pillow used to return a black image for 0 bits (every bit masked off); recent Pillow
(13.0 here) raises "bits must be between or equal to 1 and 8", which kills the data loader and the run (stock timm
too). With a magnitude std the top magnitude is drawn now and then, so the crash comes at a random step. The fix
keeps Pillow's old result for 0 bits and calls timm's own op for every other value, so valid levels are untouched.
"""
from typing import Any

from PIL import Image

__all__ = ['patch_posterize', 'posterize_keeping_zero_bits']

_POSTERIZE_OPS = ('Posterize', 'PosterizeIncreasing', 'PosterizeOriginal')


def _timm_posterize():
    from timm.data import auto_augment
    return auto_augment.posterize


def posterize_keeping_zero_bits(img: Image.Image, bits_to_keep: int, **kwargs: Any) -> Image.Image:
    """timm's posterize op, except that keeping 0 bits gives a black image (as Pillow did) instead of an error."""
    if bits_to_keep <= 0:
        return img.point(lambda _: 0)  # every bit masked off, per band
    return _timm_posterize()(img, bits_to_keep, **kwargs)


def patch_posterize() -> None:
    """Point timm's posterize ops at `posterize_keeping_zero_bits` (idempotent; before the transforms are built)."""
    from timm.data import auto_augment
    for name in _POSTERIZE_OPS:
        auto_augment.NAME_TO_OP[name] = posterize_keeping_zero_bits
