"""Why compressed requests wait more whole steps: the bench's closed loop, simulated.

A model of the engine's scheduler (backend/scheduler.py: one 512-token budget a step, running decodes
first, then unfinished prefill chunks, then waiting requests FCFS) driven by four closed-loop
clients, as in `ctxgate bench e2e --concurrency 4`: every request is a 600-token prompt and 32
output tokens, and a client sends its next request as soon as its last one ends. A step takes
40 ms plus 2.85 ms per prefill token (~1.5 s for a 512-token chunk: the AVX2 CPU of this report).
The *ideal* arm reaches the engine 20 ms after the client sends (the gateway's own work); the
*compressed* arm after one compression worker has compressed it (160 ms, +-20-40%, one at a time).

    python eval/reports/e2e-avx2-native-2026-12-02/closed_loop_sim.py [--trace]

It also runs both arms open loop (Poisson arrivals at 0.4 requests/s, about 90% of what the closed
loop serves), where no client waits on a reply.

Queue time (submission to the first step) is printed as the bench's report counts it: under 0.5 s,
about one step, two steps or more.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from dataclasses import dataclass

BUDGET_TOKENS = 512
PROMPT_TOKENS = 600
OUTPUT_TOKENS = 32
STEP_BASE_MS = 40.0
STEP_MS_PER_PREFILL_TOKEN = 2.85


@dataclass
class Request:
    number: int
    submitted_ms: float
    uncomputed: int = PROMPT_TOKENS
    outputs_left: int = OUTPUT_TOKENS
    first_step_ms: float | None = None
    first_token_ms: float | None = None
    sent_ms: float = 0.0


def simulate(compress: bool, num_requests: int = 2000, clients: int = 4, compression_ms: float = 160.0,
             gateway_ms: float = 20.0, seed: int = 0, trace: range | None = None,
             open_loop_req_s: float | None = None) -> list[Request]:
    """`open_loop_req_s`: requests arrive at that Poisson rate instead (no clients waiting on replies)."""
    rng = random.Random(seed)
    now = 0.0
    worker_free_ms = 0.0
    arrivals: list[tuple[float, int, Request]] = []
    waiting: list[Request] = []
    running: list[Request] = []
    finished: list[Request] = []
    counter = 0

    def send(at_ms: float) -> None:
        nonlocal counter, worker_free_ms
        counter += 1
        if compress:
            start = max(at_ms, worker_free_ms)
            worker_free_ms = start + compression_ms * rng.uniform(0.8, 1.4)
            submitted = worker_free_ms
        else:
            submitted = at_ms + gateway_ms
        request = Request(counter, submitted, sent_ms=at_ms)
        heapq.heappush(arrivals, (submitted, counter, request))

    if open_loop_req_s is None:
        for _ in range(clients):
            send(0.0)
    else:
        arrival_rng = random.Random(seed + 1)
        sent_at = 0.0
        for _ in range(num_requests + clients):
            sent_at += arrival_rng.expovariate(open_loop_req_s / 1000.0)
            send(sent_at)
    while len(finished) < num_requests:
        while arrivals and arrivals[0][0] <= now:
            waiting.append(heapq.heappop(arrivals)[2])
        if not running and not waiting:
            if not arrivals:
                break
            now = arrivals[0][0]
            continue
        budget = BUDGET_TOKENS
        step: list[tuple[Request, int]] = []
        for request in [r for r in running if r.uncomputed == 0] + [r for r in running if r.uncomputed > 0]:
            if budget <= 0:
                break
            tokens = 1 if request.uncomputed == 0 else min(request.uncomputed, budget)
            step.append((request, tokens))
            budget -= tokens
        while waiting and budget > 0:
            request = waiting.pop(0)
            request.first_step_ms = now
            running.append(request)
            tokens = min(request.uncomputed, budget)
            step.append((request, tokens))
            budget -= tokens
        prefill_tokens = sum(tokens for request, tokens in step if request.uncomputed > 0)
        if trace is not None and len(finished) in trace:
            print(f"t={now:9.0f} ms  step {[(r.number, tokens) for r, tokens in step]}  "
                  f"next arrivals {[(round(at), number) for at, number, _ in sorted(arrivals)]}")
        now += STEP_BASE_MS + STEP_MS_PER_PREFILL_TOKEN * prefill_tokens
        for request, tokens in step:
            if request.uncomputed > 0:
                request.uncomputed -= tokens
                if request.uncomputed == 0:
                    request.first_token_ms = now
                    request.outputs_left -= 1
            else:
                request.outputs_left -= 1
            if request.outputs_left == 0:
                running.remove(request)
                finished.append(request)
                if open_loop_req_s is None:
                    send(now)
    return finished


def describe(name: str, requests: list[Request]) -> dict[str, float]:
    queue = [r.first_step_ms - r.submitted_ms for r in requests]
    ttft = sorted(r.first_token_ms - r.sent_ms for r in requests)
    classes = (sum(q < 500 for q in queue), sum(500 <= q < 2500 for q in queue), sum(q >= 2500 for q in queue))
    p95 = ttft[int(0.95 * (len(ttft) - 1))]
    print(f"{name:10s} queue mean {statistics.mean(queue):6.0f} ms; under 0.5 s / one step / two or more: "
          f"{classes[0]} / {classes[1]} / {classes[2]} of {len(queue)}; TTFT P50 {statistics.median(ttft):5.0f} "
          f"P95 {p95:5.0f} ms")
    return {"p95": p95}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="store_true", help="print a dozen steps of each arm")
    args = parser.parse_args()
    window = range(100, 112) if args.trace else None
    if args.trace:
        print("--- ideal")
    ideal = describe("ideal", simulate(compress=False, trace=window))
    if args.trace:
        print("--- compressed")
    compressed = describe("compressed", simulate(compress=True, trace=window))
    print(f"TTFT P95 compressed / ideal: {compressed['p95'] / ideal['p95']:.2f}")
    rate = 0.4  # requests/s: ~90% of what the closed loop above serves
    print(f"--- open loop, Poisson arrivals at {rate} req/s")
    ideal = describe("ideal", simulate(compress=False, open_loop_req_s=rate))
    compressed = describe("compressed", simulate(compress=True, open_loop_req_s=rate))
    print(f"TTFT P95 compressed / ideal: {compressed['p95'] / ideal['p95']:.2f}")


if __name__ == "__main__":
    main()
