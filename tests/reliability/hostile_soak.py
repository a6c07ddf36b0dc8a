"""`make soak-hostile`: one tenant attacks while another streams normal requests
(python -m tests.reliability.hostile_soak --help).

Starts a real `ctxgate serve` (built-in engine, default model) on the loopback with a keys file of two
tenants. Phase 1: the victim alone streams chat requests with a few passages; phase 2: the same victim
load while the attacker (its own valid key) sends the hostile mix of tests/reliability/hostile_mix.py
at full speed. Writes `hostile_soak.json`, `hostile_soak.md` and the server's log into --out and exits
1 when an acceptance check fails: victim errors (must be 0), victim TTFT P95 under attack vs alone,
server RSS levelling off, attacker 5xx other than the documented overload answer.

Bounded: every victim request has `victim_timeout_s` (over it: an error), hostile requests get 5 s
after the attack phase ends, then are cancelled; the server drains for 5 s at most.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

from ctxgate.gateway.keys import hash_key
from tests.reliability.hostile_mix import MODEL, AttackStats, attack, hostile_mix, trickle
from tests.reliability.hostile_report import (
    Acceptance,
    ServerSamples,
    VictimPhase,
    build_report,
    markdown,
    sample_server,
)
from tests.support.servers import ctxgate_process, free_port, wait_http

PASSAGES = [
    (
        "Seine",
        "The Seine flows through Paris for 13 kilometres, crossed by 37 bridges. The oldest standing bridge "
        "is the Pont Neuf, finished in 1607. Barges still carry sand and grain along the river.",
    ),
    (
        "Rhine",
        "The Rhine rises in the Swiss Alps and reaches the North Sea in the Netherlands after 1,230 km. "
        "It passes Basel, Strasbourg, Cologne and Rotterdam, Europe's largest port.",
    ),
    (
        "Danube",
        "The Danube is Europe's second-longest river. It flows through ten countries and four capitals: "
        "Vienna, Bratislava, Budapest and Belgrade, before its delta on the Black Sea.",
    ),
    (
        "Thames",
        "The Thames runs 346 km through southern England and London. Its tidal reach ends at Teddington "
        "Lock; the Thames Barrier has protected London from storm surges since 1982.",
    ),
]
QUESTIONS = [
    "Which river flows through Paris?",
    "Which capitals does the Danube pass?",
    "Where does the Rhine end?",
    "When was the Thames Barrier finished?",
]
ATTACK_GRACE_S = 5.0
WARM_UP_TIMEOUT_S = 300.0


@dataclass
class SoakConfig:
    baseline_s: float = 120.0
    attack_s: float = 600.0
    victim_concurrency: int = 2
    victim_max_tokens: int = 64
    victim_timeout_s: float = 120.0
    warm_up_requests: int = 8
    attacker_concurrency: int = 6
    slow_connections: int = 3
    max_attack_requests: int = 100_000
    kinds: tuple[str, ...] = ()  # the hostile mix's kinds the attacker sends; empty: all of them
    # The server's compression caches are bounded (`compression_cache_mb`) and fill first-sight text as
    # they should: at the default 512 MB the attack fills them for longer than the soak, so their
    # designed fill would read as growth. A small bound fills in the first minutes; what grows after it
    # is memory nothing bounds.
    compression_cache_mb: int = 64
    sample_interval_s: float = 2.0
    acceptance: Acceptance = field(default_factory=Acceptance)
    out: Path = Path("soak-hostile-out")


# -- the server -------------------------------------------------------------------------------------


def _keys_file(path: Path) -> dict[str, str]:
    keys = {
        name: f"cg-soak-{name}-{secrets.token_hex(8)}" for name in ("victim", "attacker", "attacker-spent")
    }
    # Generous tenant quotas: the home policy's would refuse the attack (429) before it reaches anything;
    # the over-quota probe is a second key of the attacker's tenant whose key limit (32 tokens a
    # minute) is below any request's reservation, so every request of it is a 429.
    generous = {"tokens_per_minute": 10**9, "requests_per_minute": 10**6}
    tenants = {
        "victim": {"quota": generous, "keys": [{"sha256": hash_key(keys["victim"])}]},
        "attacker": {
            "quota": generous,
            "keys": [
                {"sha256": hash_key(keys["attacker"])},
                {"sha256": hash_key(keys["attacker-spent"]), "limits": {"tokens_per_minute": 32}},
            ],
        },
    }
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return keys


@contextmanager
def hostile_server(out: Path, compression_cache_mb: int) -> Iterator[tuple[str, int, dict[str, str]]]:
    """A `ctxgate serve` process on a free loopback port; yields (url, pid, keys by role)."""
    keys = _keys_file(out / "keys.yaml")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "--port", str(port), "--keys-file", str(out / "keys.yaml")]
    args += ["--compression-cache-mb", str(compression_cache_mb)]
    args += ["--host", "127.0.0.1", "--drain-timeout-s", "5"]  # loopback only; a stop never waits long
    with ctxgate_process(args, out / "server.log") as process:
        wait_http(f"{url}/health", timeout_s=300)
        yield url, process.pid, keys


# -- the victim -------------------------------------------------------------------------------------


def victim_body(index: int, max_tokens: int) -> dict:
    documents = [{"id": i, "title": title, "text": text} for i, (title, text) in enumerate(PASSAGES)]
    return {
        "model": MODEL,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
        "ctxgate": {"documents": documents},
    }


async def victim_request(
    client: httpx.AsyncClient, url: str, key: str, body: dict, timeout_s: float
) -> float:
    """One streamed request; its TTFT (first content chunk). Anything but a complete answer raises."""
    from ctxgate.backend.openai_api.sse import read_sse_payloads

    started = time.perf_counter()
    first: float | None = None
    finish, done = None, False
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=timeout_s
    ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")

        async def lines() -> AsyncIterator[str]:
            nonlocal done
            async for line in response.aiter_lines():
                done = done or line.strip() == "data: [DONE]"
                yield line

        async for chunk in read_sse_payloads(lines()):
            if "error" in chunk:
                raise RuntimeError(f"in-stream error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                if first is None and (choice.get("delta") or {}).get("content"):
                    first = time.perf_counter()
                finish = choice.get("finish_reason") or finish
    if not done or finish not in ("stop", "length"):
        raise RuntimeError(f"stream ended without a finish (finish_reason={finish}, [DONE]={done})")
    return (first or time.perf_counter()) - started


async def victim_load(
    client: httpx.AsyncClient, url: str, key: str, config: SoakConfig, duration_s: float
) -> VictimPhase:
    """`victim_concurrency` clients, each sending its next request as soon as the last one ends."""
    phase, deadline, counter = VictimPhase(), time.monotonic() + duration_s, iter(range(10**9))

    async def client_loop() -> None:
        while time.monotonic() < deadline:
            body = victim_body(next(counter), config.victim_max_tokens)
            try:
                async with asyncio.timeout(config.victim_timeout_s):
                    phase.ttft_s.append(await victim_request(client, url, key, body, config.victim_timeout_s))
            except TimeoutError:
                phase.errors.append(f"no complete answer within {config.victim_timeout_s:g}s")
            except (RuntimeError, httpx.HTTPError) as exc:
                phase.errors.append(f"{type(exc).__name__}: {exc}"[:400])

    await asyncio.gather(*(client_loop() for _ in range(config.victim_concurrency)))
    return phase


async def warm_up(client: httpx.AsyncClient, url: str, key: str, count: int) -> None:
    """Batch sizes up to `count` once (the engine traces a decode graph per padded batch size, slowly on
    a cold server), so neither phase pays for it."""
    bodies = [victim_body(i, max_tokens=16) for i in range(count)]
    async with asyncio.timeout(WARM_UP_TIMEOUT_S):
        await asyncio.gather(*(victim_request(client, url, key, body, WARM_UP_TIMEOUT_S) for body in bodies))


# -- the run ----------------------------------------------------------------------------------------


async def _attack_phase(
    client: httpx.AsyncClient, url: str, keys: dict[str, str], config: SoakConfig, stats: AttackStats
) -> VictimPhase:
    """The victim's load for `attack_s` with the attacker at full speed; the attack ends with it."""
    stop = asyncio.Event()
    limits = {
        "concurrency": config.attacker_concurrency,
        "max_requests": config.max_attack_requests,
        "kinds": config.kinds,
    }
    attackers = [asyncio.create_task(attack(url, keys, stop, stats, **limits))]
    attackers += [
        asyncio.create_task(trickle(url, keys["attacker"], stop, stats))
        for _ in range(config.slow_connections)
    ]
    try:
        return await victim_load(client, url, keys["victim"], config, config.attack_s)
    finally:
        stop.set()
        _, pending = await asyncio.wait(attackers, timeout=ATTACK_GRACE_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*attackers, return_exceptions=True)


async def _soak(config: SoakConfig, url: str, pid: int, keys: dict[str, str], started: float) -> dict:
    """The phases; times in the report are seconds since `started` (the server's launch)."""
    stop_sampling, samples = asyncio.Event(), ServerSamples()
    sampler = asyncio.create_task(
        sample_server(url, pid, stop_sampling, started, config.sample_interval_s, samples)
    )
    stats, timeline = AttackStats(), {}
    timeout = httpx.Timeout(config.victim_timeout_s, connect=10)
    try:
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=8)) as client:
            await warm_up(client, url, keys["victim"], config.warm_up_requests)
            timeline["warm_up_done"] = time.monotonic() - started
            baseline = await victim_load(client, url, keys["victim"], config, config.baseline_s)
            timeline["attack_from"] = time.monotonic() - started
            attacked = await _attack_phase(client, url, keys, config, stats)
            timeline["attack_to"] = time.monotonic() - started
    finally:
        stop_sampling.set()
        await sampler
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()}
    window = (timeline["attack_from"], timeline["attack_to"])
    report = build_report(settings, config.acceptance, (baseline, attacked), stats, samples, window)
    return report | {"timeline_s": {name: round(at, 1) for name, at in timeline.items()}}


def run_soak(config: SoakConfig) -> dict:
    """The whole soak; the report (also written into `config.out`, with the server's log)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with hostile_server(config.out, config.compression_cache_mb) as (url, pid, keys):
        server_up = time.monotonic() - started
        report = asyncio.run(_soak(config, url, pid, keys, started))
    report["timeline_s"] = {"server_up": round(server_up, 1), **report["timeline_s"]}
    report["timeline_s"]["server_stopped"] = round(time.monotonic() - started, 1)
    (config.out / "hostile_soak.json").write_text(json.dumps(report, indent=2))
    (config.out / "hostile_soak.md").write_text(markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = SoakConfig()
    parser.add_argument("--duration", type=float, default=defaults.attack_s, help="seconds under attack")
    parser.add_argument(
        "--baseline", type=float, default=defaults.baseline_s, help="seconds of the victim alone"
    )
    parser.add_argument("--victim-concurrency", type=int, default=defaults.victim_concurrency)
    parser.add_argument(
        "--victim-timeout",
        type=float,
        default=defaults.victim_timeout_s,
        help="seconds a victim request may take (over it: an error)",
    )
    parser.add_argument("--attacker-concurrency", type=int, default=defaults.attacker_concurrency)
    parser.add_argument("--slow-connections", type=int, default=defaults.slow_connections)
    parser.add_argument("--max-attack-requests", type=int, default=defaults.max_attack_requests)
    parser.add_argument("--max-p95-ratio", type=float, default=defaults.acceptance.max_p95_ratio)
    parser.add_argument(
        "--compression-cache-mb",
        type=int,
        default=defaults.compression_cache_mb,
        help="the server's compression cache bound (its RSS levels off near its baseline plus about twice this)",
    )
    parser.add_argument("--out", type=Path, default=defaults.out, help="report folder")
    parser.add_argument(
        "--kinds",
        default="",
        help="comma-separated kinds of the hostile mix to send (default: all); with --slow-connections 0, "
        "one kind's cost to the victim alone",
    )
    args = parser.parse_args(argv)
    kinds = tuple(kind for kind in args.kinds.split(",") if kind)
    unknown = set(kinds) - {hostile.kind for hostile in hostile_mix()}
    if unknown:
        parser.error(f"--kinds: no such kind {sorted(unknown)}")
    report = run_soak(
        SoakConfig(
            baseline_s=args.baseline,
            attack_s=args.duration,
            victim_concurrency=args.victim_concurrency,
            victim_timeout_s=args.victim_timeout,
            attacker_concurrency=args.attacker_concurrency,
            slow_connections=args.slow_connections,
            max_attack_requests=args.max_attack_requests,
            kinds=kinds,
            compression_cache_mb=args.compression_cache_mb,
            acceptance=Acceptance(max_p95_ratio=args.max_p95_ratio),
            out=args.out,
        )
    )
    print(markdown(report))
    print("soak-hostile: OK" if report["ok"] else "soak-hostile: FAILED", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
