"""argparse actions and types shared by the per-package `cli` modules (import-light).

They live in `backend`, the package every other one builds on, so no package imports `ctxgate` back.
"""

from __future__ import annotations

import argparse
import sys

MAX_NICE = 19  # the lowest CPU priority Linux gives


def at_least_one(text: str) -> int:
    """argparse type: a whole number >= 1, else an error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def nice_increment(text: str) -> int:
    """argparse type: a CPU-priority step, a whole number from 0 to 19 (Linux `nice` values)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if not 0 <= value <= MAX_NICE:
        raise argparse.ArgumentTypeError(f"must be from 0 to {MAX_NICE}, not {value}")
    return value


def positive_number(text: str) -> float:
    """argparse type: a finite number > 0, else an error naming the value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value


def warn_deprecated(old: str, new: str) -> None:
    print(f"ctxgate: warning: {old} is deprecated; use {new}", file=sys.stderr)


class StoreWithDeprecatedAliases(argparse.Action):
    """A plain store; the first option string is the name, the others are old spellings that still
    work but say so. Usage: add_argument("--input", "--dataset", action=..., deprecated=["--dataset"])."""

    def __init__(self, option_strings, dest, deprecated=(), **kwargs):
        self.deprecated = tuple(deprecated)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.deprecated:
            warn_deprecated(option_string, self.option_strings[0])
        setattr(namespace, self.dest, values)
