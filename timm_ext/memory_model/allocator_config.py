"""The caching allocator's options, read from the environment as the run's torch reads them, and the sizes they set.

Which variable is read, which options exist and how a setting is checked are rules of the torch release
(`timm_ext.memory_model.allocator_releases`, which names its sources; every function takes `software`, default the
pinned 2.14.1; a refusal names the release it models).

Options that change where device blocks land are modelled (`AllocatorConfig`); options for pinned host memory, the
allocator's lock or CUDA graph capture leave the device blocks of an eager step as they are; the rest are refused in
one line that names the option (`allocator_config`).
"""
import os
from dataclasses import dataclass
from typing import List, Mapping, Optional, Tuple

from ..errors import UsageError
from .allocator_releases import (
    DIVISION_INTERVALS, DIVISION_START_LOG2, LARGE_BUFFER, MIN_BLOCK, MIN_LARGE_ALLOC, NO_LIMIT, REFUSED, RELEASE_RULES,
    ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE, allocator_variables, has_expandable_segments, is_refused, known_options,
    parse_regex_era, read_option, release_rules, unknown_option,
)
from .versions import Software

__all__ = ['AllocatorConfig', 'allocator_config', 'allocator_setting', 'expandable_setting', 'parse_allocator_conf',
           'MIN_BLOCK', 'SMALL_SIZE', 'SMALL_BUFFER', 'LARGE_BUFFER', 'MIN_LARGE_ALLOC', 'ROUND_LARGE', 'NO_LIMIT']


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator options that change where device blocks land (defaults: torch's, no option set).

    Attributes:
        expandable_segments: One growing segment per pool (`expandable_segments:True`).
        max_split_size: Blocks of requests at or above it are never split, and requests below it never take them
            (`max_split_size_mb`).
        max_non_split_rounding: How much larger than an oversize request a cached block may be and still serve it
            (`max_non_split_rounding_mb`; the constructor sets it to `large_segment_size`).
        large_segment_size: The segment of a request between 1 and 10 MiB, and an expandable large page
            (`large_segment_size_mb`).
        roundup_power2_divisions: Per power of two from 1 MiB, how many divisions requests round up to (0: 512 B).
        garbage_collection_threshold: Fraction of a memory-fraction cap above which old free segments are released.
        single_division_exact: A division count of 1 leaves requests above 512 B unrounded (torch 1.12.1).
        variable: The environment variable it was read from ('' when none is set).
        text: That variable's value.
    """
    expandable_segments: bool = False
    max_split_size: int = NO_LIMIT
    max_non_split_rounding: int = LARGE_BUFFER
    large_segment_size: int = LARGE_BUFFER
    roundup_power2_divisions: Tuple[int, ...] = (0,) * DIVISION_INTERVALS
    garbage_collection_threshold: float = 0.0
    single_division_exact: bool = False
    variable: str = ''
    text: str = ''

    def round_size(self, nbytes: int) -> int:
        """The bytes a request of `nbytes` takes from a block (CUDACachingAllocator.cpp `round_size`)."""
        if nbytes < MIN_BLOCK:
            return MIN_BLOCK
        index = min(max(0, nbytes.bit_length() - 1 - DIVISION_START_LOG2), DIVISION_INTERVALS - 1)
        divisions = self.roundup_power2_divisions[index]  # AcceleratorAllocatorConfig::roundup_power2_divisions
        if divisions == 1 and self.single_division_exact and nbytes > MIN_BLOCK:
            return nbytes  # 1.12.1: round_size calls roundup_power2_next_division, which returns 1 division as is
        if divisions > 1 and nbytes > MIN_BLOCK * divisions:
            return _next_division(nbytes, divisions)
        return MIN_BLOCK * -(-nbytes // MIN_BLOCK)

    def segment_size(self, size: int) -> int:
        """The bytes cudaMalloc'ed for a rounded request no cached block holds (`get_allocation_size`)."""
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return self.large_segment_size
        return ROUND_LARGE * -(-size // ROUND_LARGE)


def _next_division(size: int, divisions: int) -> int:
    """`roundup_power2_next_division`: `size` up to the next of `divisions` equal steps between its powers of two."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    return size if size % step == 0 else (size // step + 1) * step


def _tokens(text: str, white_space: str = ' \t\n\v\f\r') -> List[str]:
    """`ConfigTokenizer` (2.9.1: `lexArgs`): the separators are tokens of their own, `white_space` is dropped."""
    tokens, word = [], ''
    for char in text:
        if char in ',:[]':
            if word:
                tokens.append(word)
                word = ''
            tokens.append(char)
        elif char not in white_space:
            word += char
    return tokens + [word] if word else tokens


def _error(variable: str, text: str, problem: str) -> UsageError:
    return UsageError(f'{variable or "PYTORCH_ALLOC_CONF"}={text!r}: {problem}')


def parse_allocator_conf(text: str, variable: str = 'PYTORCH_ALLOC_CONF',
                         software: Optional[Software] = None) -> AllocatorConfig:
    """`text` read as the release of `software` reads an allocator setting (2.14.1:
    AcceleratorAllocatorConfig::parseArgs and CUDAAllocatorConfig::parseArgs, one pass; the module doc for the
    others), into the options the model uses.

    Raises:
        UsageError: That torch would refuse it, or it sets an option the model cannot follow (the option and the
            release are named).
    """
    release = release_rules(software)
    if release.regex_era:
        try:
            settings = parse_regex_era(text, release)
        except ValueError as e:
            raise _error(variable, text, str(e)) from None
        return AllocatorConfig(**settings, single_division_exact=True, variable=variable, text=text)
    tokens, settings, i = _tokens(text, release.white_space), {}, 0
    while i < len(tokens):
        key = tokens[i]
        if key not in known_options(software):
            raise _error(variable, text, unknown_option(release, key))
        if tokens[i + 1:i + 2] != [':'] or i + 2 >= len(tokens):
            raise _error(variable, text, f"'{key}' needs a value, written {key}:VALUE")
        end = tokens.index(']', i + 2) if tokens[i + 2] == '[' and ']' in tokens[i + 2:] else i + 2
        value = tokens[i + 2:end + 1]
        try:
            read_option(key, value, settings, release)
        except ValueError as e:
            raise _error(variable, text, f'{release.name} refuses {key}:{"".join(value)} ({e}); fix or drop it') \
                from None
        if is_refused(key, value):
            raise _error(variable, text, f'{key}:{"".join(value)} is not modelled: {REFUSED[key]}; drop it to plan')
        i = end + 1
        if i < len(tokens):
            if tokens[i] != ',':
                raise _error(variable, text, f"expected ',' after {key}:{''.join(value)}, found '{tokens[i]}'")
            i += 1
    return AllocatorConfig(**settings, variable=variable, text=text)


def allocator_setting(environ: Mapping[str, str] = os.environ, software: Optional[Software] = None) -> Tuple[str, str]:
    """(variable, value) of the allocator setting the release reads: the first of `allocator_variables` set; ('', '')
    for none."""
    for variable in allocator_variables(software):
        if variable in environ:
            return variable, environ[variable]
    return '', ''


def allocator_config(environ: Mapping[str, str] = os.environ, software: Optional[Software] = None) -> AllocatorConfig:
    """The allocator options of the run this environment starts on the release of `software` (default: the pinned
    one); call it before planning a CUDA run.

    Raises:
        UsageError: The setting that torch reads is refused by it, or names an option the model cannot follow.
    """
    variable, text = allocator_setting(environ, software)
    return parse_allocator_conf(text, variable, software) if variable else AllocatorConfig()


def expandable_setting(environ: Mapping[str, str] = os.environ, software: Optional[Software] = None) -> Tuple[str, str]:
    """(variable, value) that turns expandable segments on and keeps the rest of the user's setting: the variable
    the release reads (when none is set: PYTORCH_ALLOC_CONF on 2.14.1, PYTORCH_CUDA_ALLOC_CONF on 2.9.1, the only one
    its device allocator reads), its options with `expandable_segments:True` in place of any expandable_segments
    option.

    Raises:
        UsageError: The user's setting is refused (`allocator_config`), or the release has no expandable segments.
    """
    release = release_rules(software)
    if not has_expandable_segments(software):
        raise UsageError(f'{release.name} has no expandable segments (the option appeared in torch 2.1)')
    config = allocator_config(environ, software)
    variable = config.variable or release.variables[-1]
    options, depth, start = [], 0, 0
    for i, char in enumerate(config.text + ','):
        depth += (char == '[') - (char == ']')
        if char == ',' and not depth:
            options.append(config.text[start:i].strip())
            start = i + 1
    kept = [o for o in options if o and o.split(':', 1)[0].strip() != 'expandable_segments']
    return variable, ','.join([*kept, 'expandable_segments:True'])
