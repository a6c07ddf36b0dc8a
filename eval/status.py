"""What a long eval or bench command tells its user while it works: one line per step on stderr, with
the seconds since the command started.

The first ~20 s of `ctxgate eval run` (reading the dataset, `ctxgate serve` loading the model, the
embedding model loading behind it) would otherwise pass in silence; stdout keeps only the results.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

# A step's one-line report; `Status` prints it, a caller may pass another (or `silent`).
StatusLine = Callable[[str], None]

# Imported when the command starts: close enough to its start for a reader counting seconds.
_STARTED = time.monotonic()


class Status:
    def __init__(self, prefix: str = "ctxgate", stream: TextIO | None = None):
        self.prefix = prefix
        self.stream = stream

    def __call__(self, message: str) -> None:
        elapsed = time.monotonic() - _STARTED
        # stderr looked up per call: pytest's capture (and a caller's redirect) swaps it after import.
        print(f"{self.prefix} [{elapsed:5.1f}s] {message}", file=self.stream or sys.stderr, flush=True)


def silent(message: str) -> None:
    """A `StatusLine` that says nothing."""


def count(number: int, noun: str) -> str:
    """`1 question`, `2 questions`."""
    return f"{number} {noun}{'' if number == 1 else 's'}"
