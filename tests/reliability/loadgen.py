"""Open-loop load on the gateway: mixed streaming, random disconnects and priorities, sent by the
benchmarks' load generator (eval/loadgen.py).

Used by the short CI load test and by `make soak` (tests/reliability/soak.py). Every request is
classified; anything that is neither a success, the documented overload answer (429/503 with
Retry-After), nor a deliberate client disconnect lands in `problems`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from ctxgate.eval.loadgen import closed_loop, open_loop, uniform_offsets

MODEL_NAME = "SmolLM2-135M-Instruct"
OVERLOAD_STATUSES = (429, 503)


@dataclass
class LoadReport:
    sent: int = 0
    accepted: int = 0
    rejected_429: int = 0
    rejected_503: int = 0
    completed: int = 0
    aborted: int = 0  # the client disconnected on purpose
    errors_5xx: int = 0  # any 5xx other than the documented overload answer (in-band errors included)
    hung: int = 0
    statuses: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def figures(self) -> dict:
        return {
            "sent": self.sent,
            "accepted": self.accepted,
            "rejected_429": self.rejected_429,
            "rejected_503": self.rejected_503,
            "completed": self.completed,
            "aborted": self.aborted,
            "errors_5xx": self.errors_5xx,
            "hung": self.hung,
            "elapsed_s": round(self.elapsed_s, 1),
            "statuses": dict(self.statuses),
        }


def _is_overload_answer(response: httpx.Response, body: bytes) -> bool:
    if response.status_code not in OVERLOAD_STATUSES or "retry-after" not in response.headers:
        return False
    try:
        return "error" in json.loads(body)
    except ValueError:
        return False


class _Request:
    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        rng: random.Random,
        report: LoadReport,
        index: int,
        max_tokens: int,
        stream_fraction: float,
        disconnect_fraction: float,
        background_fraction: float,
    ):
        self.client, self.url, self.report = client, url, report
        self.stream = rng.random() < stream_fraction
        self.disconnect_after = rng.uniform(0.05, 1.0) if rng.random() < disconnect_fraction else None
        priority = "background" if rng.random() < background_fraction else "user"
        self.body = {
            "model": MODEL_NAME,
            "max_tokens": rng.randint(1, max_tokens),
            "temperature": 0,
            "stream": self.stream,
            "messages": [{"role": "user", "content": f"Request {index}: name a colour and a number."}],
            "ctxgate": {"priority": priority},
        }
        self.admitted = False

    async def run(self, timeout_s: float) -> None:
        report = self.report
        report.sent += 1
        try:
            if self.disconnect_after is None:
                await asyncio.wait_for(self._send(), timeout_s)
            else:
                try:
                    await asyncio.wait_for(self._send(), self.disconnect_after)
                except TimeoutError:  # we hang up on purpose: the gateway must abort cleanly
                    report.aborted += 1
                    if not self.admitted:
                        report.accepted += 1
                    return
        except TimeoutError:
            report.hung += 1
            report.problems.append(f"no answer within {timeout_s}s (stream={self.stream})")
        except httpx.HTTPError as exc:
            report.problems.append(f"transport error: {exc!r}")

    async def _send(self) -> None:
        report = self.report
        if not self.stream:
            response = await self.client.post(f"{self.url}/v1/chat/completions", json=self.body)
            self._classify_status(response, response.content)
            if response.status_code == 200:
                payload = response.json()
                if (
                    payload["choices"][0]["finish_reason"] in ("stop", "length")
                    and payload["usage"]["total_tokens"]
                ):
                    report.completed += 1
                else:
                    report.problems.append(f"incomplete answer: {payload}")
            return
        async with self.client.stream("POST", f"{self.url}/v1/chat/completions", json=self.body) as response:
            if response.status_code != 200:
                self._classify_status(response, await response.aread())
                return
            self._classify_status(response, b"")
            finish, done, error = None, False, None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]
                    continue
                for choice in event.get("choices", []):
                    finish = choice.get("finish_reason") or finish
            if error is not None:
                # Headers were already sent: an in-band error is the stream's clean failure.
                report.errors_5xx += 1
                report.problems.append(f"in-band stream error: {error}")
            elif done and finish in ("stop", "length"):
                report.completed += 1
            else:
                report.problems.append(f"stream ended without finish/[DONE] (finish={finish}, done={done})")

    def _classify_status(self, response: httpx.Response, body: bytes) -> None:
        report = self.report
        status = response.status_code
        report.statuses[status] += 1
        if status == 200:
            self.admitted = True
            report.accepted += 1
        elif _is_overload_answer(response, body):
            if status == 429:
                report.rejected_429 += 1
            else:
                report.rejected_503 += 1
        elif status >= 500:
            report.errors_5xx += 1
            report.problems.append(f"{status}: {body[:300]!r}")
        else:
            report.problems.append(f"unexpected {status}: {body[:300]!r}")


async def measure_capacity(url: str, concurrency: int, num_requests: int, max_tokens: int) -> float:
    """Completed requests per second with `concurrency` clients sending non-streaming requests."""
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(index: int) -> None:
            body = {
                "model": MODEL_NAME,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Warm-up {index}: name a colour."}],
            }
            response = await client.post(f"{url}/v1/chat/completions", json=body)
            response.raise_for_status()

        started = time.perf_counter()
        await closed_loop(range(num_requests), concurrency, one)
        return num_requests / (time.perf_counter() - started)


async def run_load(
    url: str,
    *,
    rate_per_s: float,
    max_requests: int,
    duration_s: float,
    seed: int = 0,
    max_tokens: int = 8,
    stream_fraction: float = 0.5,
    disconnect_fraction: float = 0.2,
    background_fraction: float = 0.3,
    request_timeout_s: float = 90.0,
    max_outstanding: int = 64,
) -> LoadReport:
    """Send requests at `rate_per_s` (open loop) until `max_requests` or `duration_s`, then wait for all."""
    rng = random.Random(seed)
    report = LoadReport()
    limits = httpx.Limits(max_connections=max_outstanding, max_keepalive_connections=max_outstanding)
    offsets = [offset for offset in uniform_offsets(max_requests, rate_per_s) if offset <= duration_s]
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(request_timeout_s, connect=10), limits=limits
    ) as client:
        requests = [
            _Request(
                client,
                url,
                rng,
                report,
                index,
                max_tokens,
                stream_fraction,
                disconnect_fraction,
                background_fraction,
            )
            for index in range(len(offsets))
        ]

        async def one(request: _Request) -> None:
            await request.run(request_timeout_s)

        started = time.perf_counter()
        await open_loop(requests, offsets, one, max_outstanding=max_outstanding)
        report.elapsed_s = time.perf_counter() - started
    return report


def merge_reports(reports: list[LoadReport]) -> LoadReport:
    merged = LoadReport()
    for report in reports:
        for name in (
            "sent",
            "accepted",
            "rejected_429",
            "rejected_503",
            "completed",
            "aborted",
            "errors_5xx",
            "hung",
            "elapsed_s",
        ):
            setattr(merged, name, getattr(merged, name) + getattr(report, name))
        merged.statuses.update(report.statuses)
        merged.problems.extend(report.problems)
    return merged


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
