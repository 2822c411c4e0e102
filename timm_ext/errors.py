"""One base for the errors our tools report to a user: a one-line message and the exit status it ends the run with.

Every error a script should print as `prog: error: message` (not as a traceback) derives from `TimmExtError`, so
each script catches it in one clause (`report`). Argument problems exit 2, as argparse's own errors do; everything
else 1, unless the error says otherwise (a run stopped by a signal exits 128 + the signal's number).
"""
import sys
from typing import Tuple

__all__ = ['TimmExtError', 'UsageError', 'one_line', 'report']


class TimmExtError(Exception):
    """An error with a one-line message for the user and the exit status it ends the script with."""
    exit_status = 1
    label = 'error'  # the word after the program name: 'prog: error: ...'
    details: Tuple[str, ...] = ()  # lines printed under the message: the table it sums up, one fact a line


class UsageError(TimmExtError):
    """Arguments that cannot work together (or with this machine); exit 2, as argparse's errors."""
    exit_status = 2


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (whitespace and newlines collapsed)."""
    return ' '.join(str(exc).split())


def report(prog: str, exc: TimmExtError) -> int:
    """Print `prog: error: message` (then the error's `details`, indented) to stderr and return its exit status."""
    print(f'{prog}: {exc.label}: {one_line(exc)}' if exc.label else f'{prog}: {one_line(exc)}', file=sys.stderr)
    for line in exc.details:
        print(f'  {line}', file=sys.stderr)
    return exc.exit_status
