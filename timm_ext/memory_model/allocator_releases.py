"""How each torch release reads the caching allocator's setting: the variables, the options it knows, its checks.

Every function takes `software` (default: the pinned 2.14.1); the releases below were read, and any torch between
them is read by the era it falls in (`release_rules`: the eras' bounds are changes of
`timm_ext.memory_model.release_history`; outside 1.12 to 2.14 the nearest release's rules,
`versions.modelled_software`); a refusal names the run's torch. The setting is read into
sizes by `timm_ext.memory_model.allocator_config`.

torch 2.14.1 (the installed wheel's headers c10/core/AllocatorConfig.h and c10/cuda/CUDAAllocatorConfig.h, the option
names in its libc10.so / libc10_cuda.so, and c10/core/AllocatorConfig.cpp and c10/cuda/CUDAAllocatorConfig.cpp as
stored upstream):

* the first variable set of PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF, PYTORCH_ALLOC_CONF is read, an empty one
  included, and the others are ignored (`AcceleratorAllocatorConfig::instance`; checked on the wheel: with both set,
  PYTORCH_CUDA_ALLOC_CONF is the one parsed);
* `ConfigTokenizer` splits at ',', ':', '[' and ']' and drops white space; keys and values are case-sensitive, a flag
  is `True` or `False` and nothing else (`toBool`), a number is read as `std::stoull` / `std::stod` read it;
* a key neither `AcceleratorAllocatorConfig` nor `CUDAAllocatorConfig` knows is an error (`getKeys`).

torch 2.9.1 (the 2.9.1 wheel's c10/cuda/CUDAAllocatorConfig.h, whose inline `CUDAAllocatorConfig::instance` reads
PYTORCH_CUDA_ALLOC_CONF, and the option names and messages in its libc10_cuda.so; c10/cuda/CUDAAllocatorConfig.cpp
`lexArgs` / `parseArgs` read in a stored copy of that era, which the strings match):

* the device allocator reads PYTORCH_CUDA_ALLOC_CONF only. PYTORCH_ALLOC_CONF is read by c10's
  `AcceleratorAllocatorConfig` (libc10.so, first PYTORCH_ALLOC_CONF, then PYTORCH_CUDA_ALLOC_CONF with a deprecation
  warning), which in 2.9.1 only the pinned host allocator consults (libc10_cuda.so references none of it): a
  PYTORCH_ALLOC_CONF alone leaves the device blocks as the defaults place them, expandable segments included;
* `lexArgs` splits at ',', ':', '[' and ']' and drops spaces only; flags are `True` or `False`; max_split_size_mb and
  max_non_split_rounding_mb are read with `std::stoi` and must be > 20; there is no large_segment_size_mb,
  per_process_memory_fraction, throw_on_cudamalloc_oom or pinned_max_*; an unknown key is an error
  ("Unrecognized CachingAllocator option").

torch 1.12.1 (c10/cuda/CUDACachingAllocator.cpp, `CachingAllocatorConfig::parseArgs`: the 1.12.1 wheel's
libc10_cuda.so holds the variable, the two regular expressions, the three option names and every message; the code
around them read in a port of that file of the same era, torch_musa's, whose messages are the same):

* PYTORCH_CUDA_ALLOC_CONF only; options are split at runs of white space and commas (`[\\s,]+`), each option at runs
  of ':' (`[:]+`), and an option with no value after a ':' is skipped without a word;
* three options: max_split_size_mb (`std::stoi`, > 20), roundup_power2_divisions (one `std::stoi` count for every
  size, a power of 2) and garbage_collection_threshold (`std::stod`, in (0, 1)); any other key with a value is an
  error (expandable_segments appeared in torch 2.1);
* `round_size` rounds with any count above 0 and `roundup_power2_next_division` returns a size unchanged for a count
  of 1, so `roundup_power2_divisions:1` leaves requests above 512 B unrounded (`AllocatorConfig.single_division_exact`).
"""
import re
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from .release_history import ALLOCATOR_ACCELERATOR_CONFIG, ALLOCATOR_BACKEND, ALLOCATOR_EXPANDABLE, in_force
from .versions import PINNED, RELEASES, Software, in_span, modelled_software

__all__ = ['ReleaseRules', 'RELEASE_RULES', 'release_rules', 'allocator_variables', 'known_options',
           'has_expandable_segments', 'read_option', 'is_refused', 'unknown_option', 'parse_regex_era', 'VARIABLES',
           'MIN_BLOCK', 'SMALL_SIZE', 'SMALL_BUFFER', 'LARGE_BUFFER', 'MIN_LARGE_ALLOC', 'ROUND_LARGE', 'NO_LIMIT']

MiB = 1 << 20
MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = 1 * MiB  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: a small pool segment (and an expandable small pool page)
LARGE_BUFFER = 20 * MiB  # large_segment_size's default: the segment of a request under kMinLargeAlloc
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge: larger segments are rounded up to it
NO_LIMIT = (1 << 64) - 1  # std::numeric_limits<size_t>::max(): max_split_size's default (no limit)
DIVISION_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: one division count per power of two from 1 MiB (to 64 GiB)
DIVISION_START_LOG2 = 20  # kRoundUpPowerOfTwoStart = 1 MiB
VARIABLES = ('PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_HIP_ALLOC_CONF', 'PYTORCH_ALLOC_CONF')  # the order torch reads them
TORCH = 'torch 2.14.1'

FLAGS = ('expandable_segments', 'pinned_use_background_threads', 'release_lock_on_cudamalloc',
         'release_lock_on_hipmalloc', 'pinned_use_cuda_host_register', 'pinned_use_hip_host_register',
         'graph_capture_record_stream_reuse', 'pinned_free_catch_all', 'throw_on_cudamalloc_oom')
# known to torch, and without effect on where an eager step's device blocks land: host (pinned) memory, the lock,
# CUDA graph capture (train.py and validate.py capture none)
NO_DEVICE_EFFECT = ('pinned_use_background_threads', 'pinned_max_round_threshold_mb', 'pinned_max_cached_size_mb',
                    'release_lock_on_cudamalloc', 'release_lock_on_hipmalloc', 'pinned_use_cuda_host_register',
                    'pinned_use_hip_host_register', 'graph_capture_record_stream_reuse',
                    'pinned_reserve_segment_size_mb', 'pinned_num_register_threads', 'pinned_free_catch_all')
MODELLED = ('expandable_segments', 'large_segment_size_mb', 'max_split_size_mb', 'max_non_split_rounding_mb',
            'garbage_collection_threshold', 'roundup_power2_divisions')
# known to torch and not modelled: another allocator, a second cap beside --mem-budget, another out-of-memory path
REFUSED = {'backend': 'it selects CUDA\'s own allocator, which the replay does not model',
           'per_process_memory_fraction': 'it caps the allocator a second time; give the cap as --mem-budget',
           'throw_on_cudamalloc_oom': 'it changes when the allocator runs out, which the replay does not model'}
KNOWN = (*MODELLED, *NO_DEVICE_EFFECT, *REFUSED)


@dataclass(frozen=True)
class ReleaseRules:
    """How one torch release reads its allocator setting (the module doc)."""
    name: str
    variables: Tuple[str, ...]  # read for the device allocator, first set wins
    modelled: Tuple[str, ...]
    no_device_effect: Tuple[str, ...]
    refused: Tuple[str, ...]
    flags: Tuple[str, ...]
    white_space: str  # what the tokenizer drops
    split_floor_is_large_segment: bool  # max_split_size_mb >= large_segment_size (else > 20)
    regex_era: bool = False  # 1.12.1's CachingAllocatorConfig::parseArgs (regular expressions), else a tokenizer


RELEASE_RULES = {
    (2, 14, 1): ReleaseRules(TORCH, VARIABLES, MODELLED, NO_DEVICE_EFFECT, tuple(REFUSED), FLAGS, ' \t\n\v\f\r', True),
    (2, 9, 1): ReleaseRules(
        'torch 2.9.1', ('PYTORCH_CUDA_ALLOC_CONF',),
        ('expandable_segments', 'max_split_size_mb', 'max_non_split_rounding_mb', 'garbage_collection_threshold',
         'roundup_power2_divisions'),
        ('release_lock_on_cudamalloc', 'release_lock_on_hipmalloc', 'pinned_use_cuda_host_register',
         'pinned_use_hip_host_register', 'pinned_num_register_threads', 'pinned_use_background_threads',
         'graph_capture_record_stream_reuse'),
        ('backend',),
        ('expandable_segments', 'release_lock_on_cudamalloc', 'release_lock_on_hipmalloc',
         'pinned_use_cuda_host_register', 'pinned_use_hip_host_register', 'pinned_use_background_threads',
         'graph_capture_record_stream_reuse'),
        ' ', False),
    (1, 12, 1): ReleaseRules('torch 1.12.1', ('PYTORCH_CUDA_ALLOC_CONF',),
                         ('max_split_size_mb', 'roundup_power2_divisions', 'garbage_collection_threshold'), (), (), (),
                         ' \t\n\v\f\r', False, regex_era=True),
}
assert {release.torch for release in RELEASES} == set(RELEASE_RULES)


def release_rules(software: Optional[Software]) -> ReleaseRules:
    """The rules the run's torch reads its setting by (None: the pinned one): each era is a change of
    `release_history`, read at the release that ends it: 1.12.1's before `ALLOCATOR_BACKEND` (2.0, assumed), 2.9.1's
    from it (without expandable_segments before `ALLOCATOR_EXPANDABLE`, 2.1), 2.14.1's from
    `ALLOCATOR_ACCELERATOR_CONFIG` (2.10, assumed); outside the span the model covers, the nearest release's
    (`versions.modelled_software`). The rules carry the run's torch in their name."""
    software = software or PINNED
    if not in_span(software):
        software = modelled_software(software)[0]
    if in_force(ALLOCATOR_ACCELERATOR_CONFIG, software):
        era = RELEASE_RULES[(2, 14, 1)]
    elif in_force(ALLOCATOR_BACKEND, software):
        era = RELEASE_RULES[(2, 9, 1)]
        if not in_force(ALLOCATOR_EXPANDABLE, software):
            era = replace(era, modelled=tuple(o for o in era.modelled if o != 'expandable_segments'),
                          flags=tuple(o for o in era.flags if o != 'expandable_segments'))
    else:
        era = RELEASE_RULES[(1, 12, 1)]
    return replace(era, name=f"torch {'.'.join(map(str, software.torch))}")


def allocator_variables(software: Optional[Software] = None) -> Tuple[str, ...]:
    """The environment variables the device allocator reads, in the order it reads them (first set wins)."""
    return release_rules(software).variables


def known_options(software: Optional[Software] = None) -> Tuple[str, ...]:
    """The allocator options the release knows (any other is refused by that torch)."""
    release = release_rules(software)
    return (*release.modelled, *release.no_device_effect, *release.refused)


def has_expandable_segments(software: Optional[Software] = None) -> bool:
    """Whether the release knows `expandable_segments` (it appeared in torch 2.1)."""
    return 'expandable_segments' in release_rules(software).modelled


def _size(token: str) -> int:
    """`std::stoull`: the leading integer (a negative one wraps around); ValueError when there is none."""
    match = re.match(r'[+-]?\d+', token)
    if match is None:
        raise ValueError(token)
    return int(match.group()) % (1 << 64)


def _int(token: str) -> int:
    """`std::stoi` stored in a size_t: the leading int (a negative one wraps around); ValueError when there is none
    or it does not fit an int."""
    match = re.match(r'\s*[+-]?\d+', token)
    if match is None or not -(1 << 31) <= int(match.group()) < 1 << 31:
        raise ValueError(f"std::stoi reads no int from '{token}'")
    return int(match.group()) % (1 << 64)


def _number(token: str) -> float:
    """`std::stod`: the leading decimal number; ValueError when there is none."""
    match = re.match(r'[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?', token)
    if match is None:
        raise ValueError(token)
    return float(match.group())


def _divisions(value: List[str]) -> Tuple[int, ...]:
    """`parseRoundUpPower2Divisions`: one count for all, or `[boundary_mb:count, ..., >:count]`."""
    if value[0] != '[':
        count = _size(value[0])
        if count & (count - 1) or not count:
            raise ValueError('the divisions must be a power of 2')
        return (count,) * DIVISION_INTERVALS
    counts, last, first = [0] * DIVISION_INTERVALS, 0, True
    for item in ' '.join(value[1:-1]).split(' , ') if len(value) > 2 else ():
        boundary, _, count_text = item.partition(' : ')
        count = _size(count_text)
        if count & (count - 1):
            raise ValueError('the divisions must be a power of 2 or 0')
        if boundary == '>':
            counts[last + 1:] = [count] * (DIVISION_INTERVALS - last - 1)
            continue
        mb = _size(boundary)
        if not mb or mb & (mb - 1):
            raise ValueError('the intervals must be powers of 2')
        index = min(mb.bit_length() - 1, DIVISION_INTERVALS - 1)
        if first:
            counts[:index] = [count] * index
            first = False
        counts[index], last = count, index
    return tuple(counts)


def read_option(key: str, value: List[str], settings: Dict[str, object],
                release: ReleaseRules = RELEASE_RULES[(2, 14, 1)]) -> None:
    """Check one option's value as `release` does and keep what the model needs in `settings` (ValueError: refused)."""
    if key in release.flags and value[0] not in ('True', 'False'):
        raise ValueError(f"{key} takes True or False, written so, not '{value[0]}'")
    large = settings.get('large_segment_size', LARGE_BUFFER)
    if not release.split_floor_is_large_segment and key in ('max_split_size_mb', 'max_non_split_rounding_mb'):
        if _int(value[0]) <= LARGE_BUFFER // MiB:  # parseMaxSplitSize's std::stoi, "must be > 20"
            raise ValueError(f'{key} must be > {LARGE_BUFFER // MiB}')
        name = 'max_split_size' if key == 'max_split_size_mb' else 'max_non_split_rounding'
        settings[name] = min(_int(value[0]), NO_LIMIT // MiB) * MiB
    elif key == 'pinned_num_register_threads' and not release.split_floor_is_large_segment:
        threads = _int(value[0])
        if threads & (threads - 1) or not threads or threads > 128:  # 2.9.1: a power of 2, at most 128
            raise ValueError('pinned_num_register_threads must be a power of 2 up to 128')
    elif key == 'expandable_segments':
        settings['expandable_segments'] = value[0] == 'True'
    elif key == 'large_segment_size_mb':
        if _size(value[0]) <= MIN_LARGE_ALLOC // MiB:
            raise ValueError(f'large_segment_size_mb must be > {MIN_LARGE_ALLOC // MiB}')
        settings['large_segment_size'] = _size(value[0]) * MiB
    elif key in ('max_split_size_mb', 'max_non_split_rounding_mb'):
        if _size(value[0]) < large // MiB:
            raise ValueError(f'{key} must be >= {large // MiB}')
        name = 'max_split_size' if key == 'max_split_size_mb' else 'max_non_split_rounding'
        settings[name] = min(_size(value[0]), NO_LIMIT // MiB) * MiB
    elif key == 'garbage_collection_threshold':
        if not 0 < _number(value[0]) < 1:
            raise ValueError('garbage_collection_threshold must be in (0.0, 1.0)')
        settings['garbage_collection_threshold'] = _number(value[0])
    elif key == 'roundup_power2_divisions':
        settings['roundup_power2_divisions'] = _divisions(value)
    elif key == 'backend' and value[0] not in ('native', 'cudaMallocAsync'):
        raise ValueError('backend is native or cudaMallocAsync')
    elif key == 'per_process_memory_fraction' and not 0 <= _number(value[0]) <= 1:
        raise ValueError('per_process_memory_fraction must be in [0.0, 1.0]')
    elif key.endswith(('_mb', '_threads')) and key.startswith('pinned_'):
        _size(value[0])


def is_refused(key: str, value: List[str]) -> bool:
    """Whether a known option, with this value, asks for what the model does not follow (`REFUSED`)."""
    if key == 'backend':
        return value[0] != 'native'
    if key == 'per_process_memory_fraction':
        return _number(value[0]) < 1  # a fraction of 1 sets no cap (setMemoryFraction)
    return key in REFUSED and value[0] != 'False'


def unknown_option(release: ReleaseRules, key: str) -> str:
    since = ' (it appeared in torch 2.1)' if key == 'expandable_segments' else ''
    return (f"{release.name} does not know the allocator option '{key}'{since}; drop it (the options that place "
            f"device blocks: {', '.join(release.modelled)})")


def parse_regex_era(text: str, release: ReleaseRules) -> Dict[str, object]:
    """torch 1.12.1's `CachingAllocatorConfig::parseArgs` (the module doc): options split at runs of white space and
    commas, each at runs of ':'; an option without a value is skipped. The settings `read_option` keeps (ValueError: the
    setting is refused, in words)."""
    settings: Dict[str, object] = {}
    for option in re.split(r'[ \t\n\v\f\r,]+', text):
        parts = re.split(r':+', option)
        if parts and not parts[-1]:
            parts.pop()  # std::sregex_token_iterator yields no empty last piece
        if len(parts) < 2:
            continue
        key, value = parts[0], parts[1]
        if key not in release.modelled:
            raise ValueError(unknown_option(release, key))
        try:
            if key == 'roundup_power2_divisions':
                count = _int(value)
                if count & (count - 1) or not count:
                    raise ValueError('the divisions must be a power of 2')
                settings['roundup_power2_divisions'] = (count,) * DIVISION_INTERVALS
            else:
                read_option(key, [value], settings, release)
        except ValueError as e:
            raise ValueError(f'{release.name} refuses {key}:{value} ({e}); fix or drop it') from None
    return settings
