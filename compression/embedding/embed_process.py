"""The embedding model in a child process of its own, so it never holds the gateway's GIL.

An engine thread in the gateway process re-takes the GIL between every torch op of a forward pass.
A thread that runs Python at the same time (the embedding model's modules, tokenization) keeps it
for a whole switch interval each time, and the engine waits that long at every op
(docs/decisions/embedder-on-engine-thread.md). Embedding is most of the Python that compression runs, so the gateway moves it here: the caller sends texts
over a pipe and sleeps (GIL released) until the vectors come back.

The child loads the same model at the same precision (compression/embedding/embeddings.py) with its own
OpenMP budget, answers one request at a time, and exits when the pipe closes (the parent died or
closed it). A child that died is started again, and the call that found it dead is asked again.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import BinaryIO

import numpy as np

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
# Frames on the pipes: one status byte, a 4-byte big-endian length, the payload.
READY, OK, ERROR = b"r", b"o", b"e"
_HEADER = struct.Struct(">cI")


class EmbedProcessError(RuntimeError):
    pass


def write_frame(stream: BinaryIO, status: bytes, payload: bytes) -> None:
    stream.write(_HEADER.pack(status, len(payload)) + payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> tuple[bytes, bytes]:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the pipe closed")
    status, length = _HEADER.unpack(header)
    payload = stream.read(length)
    if len(payload) < length:
        raise EOFError("the pipe closed mid-frame")
    return status, payload


def serve(model_path: str, precision: str, threads: int) -> None:
    """The child: load the model, then answer JSON text lists with float32 bytes until EOF."""
    # The protocol owns the original stdout; anything the libraries print goes to stderr.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    try:
        import torch

        torch.set_num_threads(max(1, threads))
        from ctxgate.compression.embedding.embeddings import Embedder

        embedder = Embedder(model_path, precision=precision)
        embedder.warm_up()
    except BaseException as exc:  # the parent must hear why the child cannot start
        write_frame(replies, ERROR, f"{type(exc).__name__}: {exc}".encode())
        return
    write_frame(replies, READY, json.dumps({"dimension": embedder.dimension}).encode())
    while True:
        try:
            _, payload = read_frame(requests)
        except EOFError:
            return
        try:
            vectors = embedder._encode_now(json.loads(payload))
            write_frame(replies, OK, vectors.astype(np.float32, copy=False).tobytes())
        except Exception as exc:
            write_frame(replies, ERROR, f"{type(exc).__name__}: {exc}".encode())


class EmbedProcess:
    """`encode(texts)` in a child process; thread-safe (one request on the pipe at a time)."""

    def __init__(self, model_path: str | Path, precision: str, threads: int = 1):
        self.model_path = str(model_path)
        self.precision = precision
        self.threads = threads
        self.dimension = 0
        self.starts = 0
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        with self._lock:
            self._start()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def _start(self) -> None:
        # A fresh interpreter (not fork: the parent has an engine thread and torch's thread pools;
        # not multiprocessing's spawn, which would re-run the parent's __main__, i.e. the CLI).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ctxgate.compression.embedding.embed_process",
                self.model_path,
                self.precision,
                str(self.threads),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert process.stdout is not None
        timer = threading.Timer(START_TIMEOUT_S, process.kill)
        timer.start()
        try:
            status, payload = read_frame(process.stdout)
        except EOFError:
            status, payload = (
                ERROR,
                f"it exited with {process.wait()} (its stderr is this process's)".encode(),
            )
        finally:
            timer.cancel()
        if status != READY:
            process.kill()
            raise EmbedProcessError(
                f"the embedding process failed to start: {payload.decode(errors='replace')}"
            )
        self._process, self.dimension = process, int(json.loads(payload)["dimension"])
        self.starts += 1
        logger.info(
            "embedding model in process %s (%s, %d OpenMP threads)", process.pid, self.precision, self.threads
        )

    def encode(self, texts: list[str]) -> np.ndarray:
        """Rows for `texts`; a child found dead (before or during the call) is started again and
        asked once more, so a crash costs a restart, not the request."""
        request = json.dumps(list(texts)).encode()
        with self._lock:
            for attempt in (1, 2):
                if self._process is None or self._process.poll() is not None:
                    logger.warning("the embedding process is gone; starting it again")
                    self._start()
                process = self._process
                assert process is not None and process.stdin is not None and process.stdout is not None
                try:
                    write_frame(process.stdin, OK, request)
                    status, payload = read_frame(process.stdout)
                    break
                except (EOFError, OSError) as exc:
                    process.kill()
                    process.wait()
                    self._process = None
                    if attempt == 2:
                        raise EmbedProcessError(
                            f"the embedding process died twice on one call: {exc}"
                        ) from exc
        if status != OK:
            raise EmbedProcessError(f"the embedding process failed: {payload.decode(errors='replace')}")
        return np.frombuffer(payload, dtype=np.float32).reshape(len(texts), self.dimension).copy()

    def close(self) -> None:
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            assert process.stdin is not None
            process.stdin.close()  # EOF: the child exits
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))
