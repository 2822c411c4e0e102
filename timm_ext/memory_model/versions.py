"""The software a planned run uses: torch, the CUDA runtime and cuDNN, and the releases whose rules the model holds.

Kernel routing, workspaces, allocator options and autocast lists change between torch, CUDA and cuDNN releases, so a
rule of the memory model is a rule of a version (read at that release's tag). The estimate plans for the software of
the run: the installed torch's by default (`installed_software`), or what the user names for another machine
(`--software`, `parse_software`). Every versioned rule is a function of the run's own torch, CUDA and cuDNN, holding
the release where its behaviour changed (`timm_ext.memory_model.release_history`), so any torch from 1.12 to 2.14
(`COVERED_SPAN`) is planned by the rules in force at that release; where a change's release is not pinned the plan
names the side it assumed. Outside that span a run is planned with the nearest release of `RELEASES`
(`modelled_software`), and the plan says so. `RELEASES` are the points whose wheels were read and whose tables
calibrate the model; `WHEELS` gives the CUDA and cuDNN of other releases' default wheels, for a `--software` that
names only torch.

Where each release's figures were read:

* torch 1.12.1 + CUDA 11.3 + cuDNN 8.3.2: timm's RTX 3090 training table (benchmark-train-amp-nchw-pt112-cu113-
  rtx3090.csv); the cu113 wheels bundled cuDNN 8.3.2 (`torch.backends.cudnn.version()` 8302 on torch 1.12.1+cu113,
  https://github.com/pytorch/pytorch/issues/80437).
* torch 2.9.1 + CUDA 12.8 + cuDNN 9.10.2: timm's RTX 4090 dynamo table (…-pt291-cu128-4090-dynamo.csv); the PyPI wheel
  torch-2.9.1-cp311-cp311-manylinux_2_28_x86_64.whl requires nvidia-cudnn-cu12==9.10.2.21 (its METADATA).
* torch 2.9.1 + CUDA 13.0 + cuDNN 9.13.0: timm's RTX 5090 and RTX Pro 6000 tables (…-pt291-cu130-*.csv); the cu130
  wheels (download.pytorch.org/whl/cu130) require nvidia-cudnn-cu13==9.13.0.50 (PYTORCH_EXTRA_INSTALL_REQUIREMENTS of
  pytorch's CUDA 13.0 manywheel builds in the 2.9 release).
* torch 2.14.1 + CUDA 13.0 + cuDNN 9.24.0: this project's pin (requirements.txt); the wheel requires
  nvidia-cudnn-cu13==9.24.0.43 (its METADATA).
"""
import re
from dataclasses import dataclass
from typing import Optional, Tuple

from ..errors import UsageError
from .release_history import assumed_changes

__all__ = ['Software', 'RELEASES', 'PINNED', 'COVERED_SPAN', 'WHEELS', 'installed_software', 'parse_software',
           'modelled_software', 'run_software', 'software_flag_problem', 'add_software_argument']

Version = Tuple[int, ...]


def _version(text: str, parts: int) -> Version:
    """The first `parts` numbers of a version string ('2.14.1+cu130' -> (2, 14, 1)); missing ones are 0."""
    numbers = [int(n) for n in re.findall(r'\d+', text.split('+')[0])][:parts]
    if not numbers:
        raise ValueError(f'not a version: {text!r}')
    return tuple(numbers + [0] * (parts - len(numbers)))


def _dotted(version: Optional[Version]) -> str:
    return '.'.join(map(str, version)) if version else 'none'


@dataclass(frozen=True)
class Software:
    """The torch, CUDA runtime and cuDNN of a run.

    Attributes:
        torch: torch's (major, minor, patch).
        cuda: The CUDA runtime torch was built with, (major, minor); None for a build without CUDA.
        cudnn: cuDNN's (major, minor, patch); None where there is none.
    """
    torch: Tuple[int, int, int]
    cuda: Optional[Tuple[int, int]]
    cudnn: Optional[Tuple[int, int, int]]

    def __str__(self) -> str:
        named = (('torch', self.torch), ('CUDA', self.cuda), ('cuDNN', self.cudnn))
        return ', '.join(f'{name} {_dotted(version)}' for name, version in named if version)

    @property
    def cudnn_number(self) -> int:
        """cuDNN's version as `torch.backends.cudnn.version()` gives it (cudnn.h's CUDNN_VERSION: major x 1000 before
        cuDNN 9, major x 10000 from 9, + minor x 100 + patch); 0 without cuDNN."""
        if self.cudnn is None:
            return 0
        major, minor, patch = self.cudnn
        return major * (10000 if major >= 9 else 1000) + minor * 100 + patch


RELEASES: Tuple[Software, ...] = (
    Software((1, 12, 1), (11, 3), (8, 3, 2)),
    Software((2, 9, 1), (12, 8), (9, 10, 2)),
    Software((2, 9, 1), (13, 0), (9, 13, 0)),
    Software((2, 14, 1), (13, 0), (9, 24, 0)),
)
PINNED = RELEASES[-1]  # requirements.txt's torch, and its wheel's CUDA and cuDNN
COVERED_SPAN = ((1, 12), (2, 14))  # the minor releases whose rules the model holds (release_history)
# the CUDA and cuDNN of each minor release's default PyPI wheel (its Requires-Dist nvidia-cudnn-cu1x pin), where a
# --software names only torch: recalled from the wheels' METADATA, not re-read here (an assumption the plan names);
# 2.11 to 2.13 are assumed to ship what 2.14.1 ships
WHEELS = {
    (1, 13): ((11, 7), (8, 5, 0)), (2, 0): ((11, 7), (8, 5, 0)), (2, 1): ((12, 1), (8, 9, 2)),
    (2, 2): ((12, 1), (8, 9, 2)), (2, 3): ((12, 1), (8, 9, 2)), (2, 4): ((12, 1), (9, 1, 0)),
    (2, 5): ((12, 4), (9, 1, 0)), (2, 6): ((12, 4), (9, 1, 0)), (2, 7): ((12, 6), (9, 5, 1)),
    (2, 8): ((12, 8), (9, 10, 2)), (2, 10): ((12, 8), (9, 10, 2)), (2, 11): ((13, 0), (9, 24, 0)),
    (2, 12): ((13, 0), (9, 24, 0)), (2, 13): ((13, 0), (9, 24, 0)),
}


def installed_software() -> Software:
    """The software of this process's torch (a build without CUDA plans with its release's CUDA and cuDNN).

    cuDNN's version is the loaded library's own (`cudnnGetVersion`, through `torch._C._cudnn`), not
    `torch.backends.cudnn.version()`, which queries every device first: a plan must not create a CUDA context in a
    process that hands the GPU to its training children.
    """
    import torch
    version = _version(torch.__version__, 3)
    if not torch.version.cuda:
        return Software(version, None, None)
    cudnn_module = getattr(torch._C, '_cudnn', None)
    cudnn = tuple(cudnn_module.getRuntimeVersion()) if cudnn_module is not None else None
    return Software(version, _version(torch.version.cuda, 2), cudnn)


def parse_software(text: str) -> Software:
    """`--software`'s value: 'torch=2.9.1,cuda=13.0,cudnn=9.13.0' (keys in any order; cuda and cudnn may be left
    out: the covered release of that torch gives them).

    Raises:
        UsageError: A key that is not torch, cuda or cudnn, a value that is not a version, or no torch.
    """
    found = {}
    for item in filter(None, (part.strip() for part in text.split(','))):
        key, _, value = item.partition('=')
        key = key.strip().lower()
        if key not in ('torch', 'cuda', 'cudnn') or not value.strip():
            raise UsageError(f'--software {text}: {item!r} is not torch=X.Y.Z, cuda=X.Y or cudnn=X.Y.Z; write e.g. '
                             f'--software torch=2.9.1,cuda=13.0,cudnn=9.13.0')
        try:
            if not re.fullmatch(r'\d+(\.\d+){0,3}', value.strip()):  # digits only: '2.x' is not 2.0.0
                raise ValueError(value)
            found[key] = _version(value.strip(), 3 if key != 'cuda' else 2)
        except ValueError:
            raise UsageError(f'--software {text}: {value.strip()!r} is not a version; write e.g. '
                             f'--software torch=2.9.1,cuda=13.0') from None
    if 'torch' not in found:
        raise UsageError(f'--software {text}: names no torch; write e.g. --software torch=2.9.1,cuda=13.0')
    same_torch = [r for r in RELEASES if r.torch == found['torch']]
    base = min(same_torch, key=lambda r: _distance(r.cuda, found.get('cuda'))) if same_torch else None
    return Software(found['torch'], found.get('cuda', base.cuda if base else None),
                    found.get('cudnn', base.cudnn if base else None))


def _wheel(torch: Version) -> Optional[Tuple[Tuple[int, int], Tuple[int, int, int]]]:
    """(CUDA, cuDNN) of that torch's default wheel: a covered release's own, else `WHEELS`' (None: not known)."""
    same = [r for r in RELEASES if r.torch[:2] == tuple(torch[:2])]
    if same:
        return same[0].cuda, same[0].cudnn
    return WHEELS.get(tuple(torch[:2]))


def in_span(software: Software) -> bool:
    """Whether the model's versioned rules reach this torch (`COVERED_SPAN`)."""
    return COVERED_SPAN[0] <= tuple(software.torch[:2]) <= COVERED_SPAN[1]


def _distance(a: Optional[Version], b: Optional[Version]) -> int:
    """How far apart two (major, minor) versions are, majors first (None is the farthest)."""
    if a is None or b is None:
        return 0 if a == b else 1 << 20
    return abs((a[0] * 100 + a[1]) - (b[0] * 100 + b[1]))


def modelled_software(software: Software) -> Tuple[Software, str]:
    """The software whose rules plan `software`, and a note for the plan ('' where nothing was assumed).

    From torch 1.12 to 2.14 (`COVERED_SPAN`) the run's torch is kept: every rule is a function of it, and the note
    names each change whose release is not pinned and which side of it the plan took
    (`release_history.assumed_changes`). Outside the span torch's rules are those of the nearest release of
    `RELEASES` (by minor release), and the note says so. The run's CUDA and cuDNN are kept: the rules that depend on
    them are functions of their own versions; one not known (a build without CUDA, or left out of `--software`) is
    that torch's default wheel's (`WHEELS`), else the nearest release's.
    """
    nearest = min(RELEASES, key=lambda r: (_distance(r.torch[:2], software.torch[:2]), r.torch != software.torch,
                                           _distance(r.cuda, software.cuda), r.torch))
    inside = in_span(software)
    wheel = _wheel(software.torch) if inside else None
    cuda, cudnn = wheel if wheel else (nearest.cuda, nearest.cudnn)
    modelled = Software(software.torch if inside else nearest.torch, software.cuda or cuda, software.cudnn or cudnn)
    notes = []
    if not inside:
        notes.append(f'torch {_dotted(software.torch)} is outside the releases the model\'s rules cover '
                     f'({_dotted(COVERED_SPAN[0])} to {_dotted(COVERED_SPAN[1])}): planned with the rules of the '
                     f'nearest covered release, torch {_dotted(modelled.torch)}')
    unknown = [f'{name} {_dotted(value)}' for name, value, known in (('CUDA', modelled.cuda, software.cuda),
                                                                      ('cuDNN', modelled.cudnn, software.cudnn))
               if known is None]
    if unknown:
        whose = f"torch {_dotted(nearest.torch)}'s wheel" if not wheel else (
            f"torch {_dotted(software.torch[:2])}'s default wheel" + ('' if any(
                r.torch[:2] == tuple(software.torch[:2]) for r in RELEASES) else ', as recalled'))
        notes.append(f"{' and '.join(unknown)} assumed ({whose})")
    if inside:
        notes.extend(assumed_changes(modelled))
    return modelled, '; '.join(notes)


def run_software(spec: Optional[str]) -> Tuple[Software, str]:
    """The software a CUDA plan models, and the plan's line on it: `--software`'s `spec` where given, else the
    installed torch's (`modelled_software` picks the covered release and notes what it substituted)."""
    asked = parse_software(spec) if spec else installed_software()
    modelled, note = modelled_software(asked)
    origin = 'named by --software' if spec else 'installed here'
    detail = f'{origin}; the model covers it' if not note else f'{origin}: {asked}; {note}'
    return modelled, f'Software modelled: {modelled} ({detail}).'


def software_flag_problem(text: Optional[str], device: str, estimate: bool) -> Optional[str]:
    """Why `--software text` cannot be used (one line), or None."""
    if text is None:
        return None
    if not estimate:
        return ('argument --software: plans for software that is not here and needs --estimate; add --estimate, or '
                'drop --software to measure the run here')
    if device.split(':', 1)[0] != 'cuda':
        return 'argument --software: names CUDA software; drop it, or pass --device cuda to plan for it'
    try:
        parse_software(text)
    except UsageError as e:
        return f'argument {e}'
    return None


def add_software_argument(group) -> None:
    """`--software`, for tune_batch.py and validate.py (one definition)."""
    group.add_argument('--software', default=None, metavar='SPEC',
                       help="with --estimate: plan for this torch, CUDA and cuDNN instead of the installed ones, "
                            "e.g. 'torch=2.9.1,cuda=13.0,cudnn=9.13.0' (cuda and cudnn default to that torch's "
                            "wheel); any torch from 1.12 to 2.14 is planned with the rules in force at that release "
                            "(the plan names what it assumed), others with the nearest of: "
                            + '; '.join(map(str, RELEASES)))
