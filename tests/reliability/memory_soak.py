"""`make memory-soak`: does a real gateway's memory level off under first-sight traffic?

Starts `ctxgate serve` (built-in engine, rag-default) with `--compression-cache-mb`, sends
`--requests` compresses, each with a unique ~20 KB document (nothing any cache has seen), and
samples the server's RSS (its process and children) every `--every` requests. Prints the curve and
the slope over the last half in MB per 100 requests; "levelled" when that slope is under
`--max-slope`. Exit status 1 when it did not level.

    python -m tests.reliability.memory_soak --requests 600 --compression-cache-mb 64
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.security.test_fair_compression import compress_body, unique_document
from tests.support.servers import ctxgate_process, free_port, wait_http

PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 1024 / 1024


@dataclass
class Sample:
    requests: int
    rss_mb: float


def tree_rss_mb(pid: int) -> float:
    """Resident memory of `pid` and its descendants (the embedding child process, if any), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        try:
            total += int((Path("/proc") / str(current) / "statm").read_text().split()[1]) * PAGE_MB
        except (OSError, IndexError, ValueError):
            continue
        stack.extend(children.get(current, []))
    return total


def slope_per_100(samples: list[Sample]) -> float:
    """Least-squares slope of RSS against requests over the last half of the samples, per 100 requests."""
    half = samples[len(samples) // 2 :]
    if len(half) < 2:
        return 0.0
    mean_x = sum(s.requests for s in half) / len(half)
    mean_y = sum(s.rss_mb for s in half) / len(half)
    num = sum((s.requests - mean_x) * (s.rss_mb - mean_y) for s in half)
    den = sum((s.requests - mean_x) ** 2 for s in half)
    return 100 * num / den if den else 0.0


def soak(url: str, pid: int, requests: int, every: int, doc_chars: int, concurrency: int) -> list[Sample]:
    samples = [Sample(0, tree_rss_mb(pid))]
    with httpx.Client(timeout=300) as client, ThreadPoolExecutor(concurrency) as pool:

        def one(index: int) -> int:
            body = compress_body(unique_document(doc_chars, 1_000_000 + index))
            return client.post(f"{url}/v1/ctxgate/compress", json=body).status_code

        for start in range(0, requests, every):
            statuses = list(pool.map(one, range(start, min(start + every, requests))))
            bad = [status for status in statuses if status != 200]
            if bad:
                raise RuntimeError(f"compress answered {bad[:5]}")
            samples.append(Sample(min(start + every, requests), tree_rss_mb(pid)))
            print(f"  {samples[-1].requests:6d} requests  RSS {samples[-1].rss_mb:8.1f} MB", flush=True)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--every", type=int, default=50, help="requests between RSS samples")
    parser.add_argument("--doc-chars", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument(
        "--compression-cache-mb", type=int, default=None, help="default: the server's default"
    )
    parser.add_argument("--max-slope", type=float, default=2.0, help="MB per 100 requests counted as level")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = ["serve", "--port", str(port), "--default-policy", "rag-default"]
    if args.compression_cache_mb is not None:
        serve += ["--compression-cache-mb", str(args.compression_cache_mb)]
    with tempfile.TemporaryDirectory() as tmp, ctxgate_process(serve, Path(tmp) / "gateway.log") as process:
        wait_http(f"{url}/ready", timeout_s=300)
        started = time.perf_counter()
        samples = soak(url, process.pid, args.requests, args.every, args.doc_chars, args.concurrency)
        seconds = time.perf_counter() - started
    slope = slope_per_100(samples)
    levelled = slope < args.max_slope
    print(
        f"{args.requests} requests in {seconds:.0f}s; RSS {samples[0].rss_mb:.0f} -> {samples[-1].rss_mb:.0f} MB "
        f"(peak {max(s.rss_mb for s in samples):.0f}); last-half slope {slope:+.2f} MB/100 requests: "
        f"{'levelled' if levelled else 'still growing'}"
    )
    return 0 if levelled else 1


if __name__ == "__main__":
    sys.exit(main())
