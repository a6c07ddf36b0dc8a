"""`make soak`: the load test, longer, printing its figures (python -m tests.reliability.soak --help).

Runs the real engine (small KV pool, so preemption and overload happen) behind a real gateway on a
loopback port, measures capacity, drives it at `--factor` times that for `--duration` seconds and
prints: requests sent, accepted, rejected (429/503), completed, aborted, 5xx, leaked KV blocks, RSS.
Exits 1 if any assertion of the CI load test would fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 180)")
    parser.add_argument("--max-requests", type=int, default=2000)
    parser.add_argument("--factor", type=float, default=2.0, help="offered load / measured capacity")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.model.model_prepare import prepare_default_model
    from ctxgate.gateway.app import create_app
    from tests.reliability.conftest import gateway_settings, small_engine_config
    from tests.reliability.loadgen import measure_capacity, merge_reports, rss_bytes, run_load
    from tests.support.servers import ServerThread
    from tests.support.waiting import wait_until_engine_idle

    engine = AsyncEngine(small_engine_config(prepare_default_model()), max_waiting_requests=4)
    with tempfile.TemporaryDirectory() as root:
        app = create_app(gateway_settings(Path(root), max_queued=2, queue_timeout_s=1.0), engine=engine)
        with ServerThread(app) as server:
            capacity = asyncio.run(measure_capacity(server.url, concurrency=4, num_requests=8, max_tokens=8))
            asyncio.run(
                run_load(
                    server.url,
                    rate_per_s=args.factor * capacity,
                    max_requests=12,
                    duration_s=10,
                    seed=args.seed + 1,
                )
            )
            wait_until_engine_idle(engine)
            rss_start = rss_bytes()
            started = time.monotonic()
            # Three equal segments, RSS after each: growth that continues after the first is a leak.
            segments, rss_after = [], []
            for part in range(3):
                segments.append(
                    asyncio.run(
                        run_load(
                            server.url,
                            rate_per_s=args.factor * capacity,
                            max_requests=args.max_requests // 3,
                            duration_s=args.duration / 3,
                            seed=args.seed + 10 * part,
                        )
                    )
                )
                rss_after.append(round(rss_bytes() / 2**20, 1))
            report = merge_reports(segments)
            try:
                wait_until_engine_idle(engine, timeout_s=60)
            except AssertionError as exc:
                print(exc, file=sys.stderr)
            stats = engine.stats()
            rss_end = rss_bytes()
            admission = app.state.admission.stats()
    engine.shutdown()
    figures = {
        "capacity_req_per_s": round(capacity, 2),
        "offered_req_per_s": round(args.factor * capacity, 2),
        **report.figures(),
        "leaked_kv_blocks": stats.num_kv_blocks_total - stats.num_kv_blocks_free,
        "kv_blocks_total": stats.num_kv_blocks_total,
        "preemptions": stats.num_preemptions,
        "in_flight_at_end": admission.in_flight,
        "rss_start_mib": round(rss_start / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_after_each_third_mib": rss_after,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(figures, indent=2))
    for problem in report.problems[:20]:
        print("problem:", problem, file=sys.stderr)
    ok = (
        not report.problems
        and report.errors_5xx == 0
        and figures["leaked_kv_blocks"] == 0
        and admission.in_flight == 0
        and not engine.engine.sequences
        and rss_end - rss_start < 200 * 2**20
        and rss_after[2] - rss_after[1] < 50
    )
    print("soak: OK" if ok else "soak: FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
