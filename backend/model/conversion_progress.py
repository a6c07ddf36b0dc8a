"""What a model conversion tells whoever waits for it: a line per step, and a bar over the tensors.

`ctxgate model prepare` shows both on stderr (stdout carries only the converted folder, for
`MODEL_DIR=$(ctxgate model prepare)`); the bar only on a terminal, where it redraws in place (in a
log or a pipe it would be a pile of partial lines). A server converting a model on its first start
logs the steps instead.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Protocol, TextIO, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ConversionProgress(Protocol):
    def step(self, message: str) -> None: ...

    def tensors(self, tensors: Sequence[T], description: str) -> Iterable[T]: ...


class LoggedProgress:
    """Steps as INFO log lines, no bar."""

    def step(self, message: str) -> None:
        logger.info("%s", message)

    def tensors(self, tensors: Sequence[T], description: str) -> Iterable[T]:
        return tensors


class ConsoleProgress:
    """Steps as lines on `stream` with the seconds since the start; a tqdm bar over the tensors
    when `stream` is a terminal. `quiet` drops both."""

    def __init__(self, stream: TextIO | None = None, quiet: bool = False, prefix: str = "ctxgate model"):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.prefix = prefix
        self.started = time.monotonic()

    def step(self, message: str) -> None:
        if not self.quiet:
            elapsed = time.monotonic() - self.started
            print(f"{self.prefix} [{elapsed:5.1f}s] {message}", file=self.stream, flush=True)

    def tensors(self, tensors: Sequence[T], description: str) -> Iterable[T]:
        import shutil

        from tqdm import tqdm

        size = shutil.get_terminal_size()
        return tqdm(
            tensors,
            desc=description,
            unit="tensor",
            file=self.stream,
            # A terminal that reports no size (a bare pseudo-terminal) gets no bar from tqdm's own
            # measure; shutil falls back to $COLUMNS/$LINES, then 80x24.
            ncols=size.columns,
            nrows=size.lines,
            disable=self.quiet or not self.stream.isatty(),
        )
