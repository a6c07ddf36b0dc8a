"""What `make soak-hostile` measures and reports: the victim's answers, the server's RSS and /health
latency over time, and the acceptance checks over them (tests/reliability/hostile_soak.py runs it)."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

import httpx

from ctxgate.eval.stats import percentiles
from tests.reliability.hostile_mix import AttackStats


@dataclass
class VictimPhase:
    ttft_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def figures(self) -> dict:
        return {
            "requests": len(self.ttft_s) + len(self.errors),
            "completed": len(self.ttft_s),
            "errors": len(self.errors),
            "ttft_s": percentiles(self.ttft_s),
        }


@dataclass
class ServerSamples:
    """RSS (seconds since the start, MiB) and /health latency (None: no answer), every interval."""

    rss: list[tuple[float, float]] = field(default_factory=list)
    health_s: list[float | None] = field(default_factory=list)


@dataclass(frozen=True)
class Acceptance:
    max_p95_ratio: float = 2.0
    # A last-half slope under this counts as level, whatever the first half did (noise on a flat line).
    rss_flat_mib_per_min: float = 5.0


def tree_rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its descendants (the embedder may run in a child process)."""
    total_kib, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/status") as status:
                total_kib += next((int(line.split()[1]) for line in status if line.startswith("VmRSS:")), 0)
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as children:
                    pending.extend(int(child) for child in children.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return round(total_kib / 1024, 1)


async def sample_server(
    url: str, pid: int, stop: asyncio.Event, started: float, interval_s: float, samples: ServerSamples
) -> None:
    """The server's RSS and the latency of GET /health every `interval_s`, until `stop`."""
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            samples.rss.append((round(time.monotonic() - started, 1), tree_rss_mib(pid)))
            began = time.perf_counter()
            try:
                (await client.get(f"{url}/health")).raise_for_status()
                samples.health_s.append(round(time.perf_counter() - began, 3))
            except httpx.HTTPError:
                samples.health_s.append(None)
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass


def _slope_mib_per_min(points: list[tuple[float, float]]) -> float:
    mean_t = sum(t for t, _ in points) / len(points)
    mean_m = sum(m for _, m in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return 60 * sum((t - mean_t) * (m - mean_m) for t, m in points) / spread if spread else 0.0


def rss_trend(samples: list[tuple[float, float]], flat_mib_per_min: float) -> dict:
    """Levels off: the last half's slope is at most half the first half's, or under `flat_mib_per_min`."""
    if len(samples) < 6:
        return {"levels_off": None, "reason": "fewer than 6 samples"}
    half = len(samples) // 2
    first, last = _slope_mib_per_min(samples[:half]), _slope_mib_per_min(samples[half:])
    return {
        "start_mib": samples[0][1],
        "peak_mib": max(m for _, m in samples),
        "end_mib": samples[-1][1],
        "first_half_slope_mib_per_min": round(first, 2),
        "last_half_slope_mib_per_min": round(last, 2),
        "levels_off": last <= max(0.5 * first, flat_mib_per_min),
    }


def build_report(
    settings: dict,
    acceptance: Acceptance,
    victim: tuple[VictimPhase, VictimPhase],
    stats: AttackStats,
    samples: ServerSamples,
    attack_window: tuple[float, float],
) -> dict:
    """The JSON report; `victim` is (alone, under attack)."""
    baseline, attacked = victim
    alone, under = baseline.figures(), attacked.figures()
    p95_alone, p95_under = alone["ttft_s"]["p95"], under["ttft_s"]["p95"]
    ratio = round(p95_under / p95_alone, 2) if p95_alone and p95_under else None
    window = [s for s in samples.rss if attack_window[0] <= s[0] <= attack_window[1]]
    trend = rss_trend(window, acceptance.rss_flat_mib_per_min)
    answered = [h for h in samples.health_s if h is not None]
    served_both = bool(baseline.ttft_s and attacked.ttft_s)
    checks = {
        "victim_no_errors": served_both and not baseline.errors and not attacked.errors,
        "victim_ttft_p95_within_ratio": ratio is not None and ratio <= acceptance.max_p95_ratio,
        "rss_levels_off": bool(trend["levels_off"]),
        "attacker_no_5xx": not stats.server_errors,
    }
    return {
        "settings": settings,
        "victim": {
            "alone": alone,
            "under_attack": under,
            "ttft_p95_ratio": ratio,
            "errors": (baseline.errors + attacked.errors)[:50],
        },
        "attacker": stats.figures(),
        "rss": {**trend, "attack_window_s": [round(t, 1) for t in attack_window], "samples": samples.rss},
        "health_s": {
            **percentiles(answered),
            "max": max(answered, default=None),
            "unanswered": len(samples.health_s) - len(answered),
        },
        "checks": checks,
        "ok": all(checks.values()),
    }


def markdown(report: dict) -> str:
    victim, attacker, rss, health = report["victim"], report["attacker"], report["rss"], report["health_s"]
    rows = [
        f"| {name} | {phase['requests']} | {phase['errors']} | {phase['ttft_s']['p50']} | {phase['ttft_s']['p95']} |"
        for name, phase in (("alone", victim["alone"]), ("under attack", victim["under_attack"]))
    ]
    lines = [
        "# Hostile soak",
        "",
        "| victim | requests | errors | TTFT P50 s | TTFT P95 s |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"TTFT P95 ratio (under attack / alone): {victim['ttft_p95_ratio']}",
        "",
        f"Server RSS over the attack: {rss.get('start_mib')} -> {rss.get('end_mib')} MiB "
        f"(peak {rss.get('peak_mib')}); slope first half {rss.get('first_half_slope_mib_per_min')}, "
        f"last half {rss.get('last_half_slope_mib_per_min')} MiB/min; levels off: {rss.get('levels_off')}",
        "",
        f"/health latency: P50 {health['p50']} s, max {health['max']} s, unanswered {health['unanswered']}",
        "",
        f"Attacker: {attacker['sent']} requests, statuses {attacker['statuses']}",
        "",
        f"Timeline (s): {report.get('timeline_s')}",
        "",
        "| check | passed |",
        "| --- | --- |",
        *(f"| {name} | {passed} |" for name, passed in report["checks"].items()),
    ]
    if victim["errors"]:
        lines += ["", "Victim errors (first 10):", *(f"- {error}" for error in victim["errors"][:10])]
    if attacker["server_errors"]:
        lines += ["", "Attacker 5xx (first 10):", *(f"- {error}" for error in attacker["server_errors"][:10])]
    return "\n".join(lines) + "\n"
