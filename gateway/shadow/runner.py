"""Shadow requests: after a sampled live request has answered, its uncompressed prompt is answered
again, greedily and at the engine's lowest priority, and the two answers are compared.

Rules (docs/deploying.md, "Shadow agreement"):
- only a greedy live request (temperature 0, one choice) is shadowed: a sampled answer would differ
  from any other sample, compressed or not, so its comparison would measure the sampling;
- only a request whose prompt compression changed, and whose uncompressed prompt is at most
  `max_prompt_tokens`;
- never on the live request's path: `after_live` only decides and starts a task; the work runs on the
  engine as `Priority.SHADOW` (admitted behind every other request, dropped when real work needs room);
- bounded: at most `max_in_flight` at once, each for at most `timeout_s`;
- every sampled request that is not compared is counted with its reason (`ctxgate:shadow_dropped_total`);
- the tokens are the operator's: nothing here reserves or settles a tenant's quota or spend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ctxgate.backend.engine.api import (
    SHADOW_PREEMPTED,
    EngineClient,
    EngineError,
    GenerationRequest,
    Priority,
)
from ctxgate.backend.engine.deltas import DeltaTotals
from ctxgate.gateway.prepared import Prepared
from ctxgate.gateway.prompt_building import PromptBuilder
from ctxgate.gateway.shadow.compare import compare
from ctxgate.gateway.shadow.ledger import ANSWER_CHARS, ShadowLedger, ShadowRecord
from ctxgate.gateway.shadow.load import ShadowLoad
from ctxgate.gateway.shadow.log import ShadowLog, log_line, prompt_hash
from ctxgate.gateway.shadow.metrics import ShadowMetrics
from ctxgate.policies.shadow import ShadowPolicy

logger = logging.getLogger(__name__)

# Client fields a shadow request to an upstream does not copy from the live one: it is greedy, one
# choice, no log probabilities, whatever the client asked.
_NOT_SHADOWED = frozenset(
    {"temperature", "top_p", "top_k", "min_p", "seed", "n", "best_of", "logprobs", "top_logprobs"}
)


class _Dropped(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class LiveRun:
    """What a shadow request needs of its finished live request."""

    prepared: Prepared
    generation: GenerationRequest
    answer: str
    completion_tokens: int


def live_is_greedy(prepared: Prepared) -> bool:
    if prepared.forward is not None:  # an upstream: what the client sent (absent: the server's default)
        temperature = prepared.forward.get("temperature")
        return isinstance(temperature, int | float) and temperature == 0
    return prepared.sampling.temperature == 0


class ShadowRunner:
    def __init__(
        self,
        engine: EngineClient,
        prompts: PromptBuilder,
        load: ShadowLoad,
        metrics: ShadowMetrics,
        ledger: ShadowLedger,
        log: ShadowLog | None = None,
        draw: Callable[[], float] = random.random,
    ):
        self.engine = engine
        self.prompts = prompts
        self.load = load
        self.metrics = metrics
        self.ledger = ledger
        self.log = log
        self._draw = draw
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def after_live(self, prepared: Prepared, generation: GenerationRequest, totals: DeltaTotals) -> None:
        """A live request answered: shadow it if sampled and allowed. Returns at once, and never
        raises into the live request's answer."""
        try:
            self._consider(prepared, generation, totals)
        except Exception:
            logger.exception("shadowing %s failed", prepared.request_id)

    def _consider(self, prepared: Prepared, generation: GenerationRequest, totals: DeltaTotals) -> None:
        shadow = prepared.policy.shadow
        if shadow.sample_rate <= 0 and shadow.upstream_fixed_rate <= 0:
            return  # the common case: nothing to decide, nothing to read of the engine
        # An engine whose load is unknown cannot be checked for idle capacity: the operator's fixed
        # rate applies instead; without one, what sample_rate draws is counted as load_unknown.
        unknown = shadow.only_when_idle and not self.load.known()
        fixed = unknown and shadow.upstream_fixed_rate > 0
        rate = shadow.upstream_fixed_rate if fixed else shadow.sample_rate
        if rate <= 0 or self._draw() >= rate:
            return
        self.metrics.sampled.labels(prepared.policy.name).inc()
        self.ledger.sampled(prepared.tenant.name, prepared.policy.name)
        if unknown and not fixed:
            self._drop(prepared, "load_unknown")
            return
        reason = self._refusal(prepared, shadow, idle_rule=shadow.only_when_idle and not unknown)
        if reason is not None:
            self._drop(prepared, reason)
            return
        live = LiveRun(prepared, generation, totals.text, totals.completion_tokens)
        task = asyncio.get_running_loop().create_task(self._run(live), name=f"shadow-{prepared.request_id}")
        self._tasks.add(task)
        self.metrics.in_flight.set(len(self._tasks))
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self.metrics.in_flight.set(len(self._tasks))

    def _refusal(self, prepared: Prepared, shadow: ShadowPolicy, idle_rule: bool) -> str | None:
        result = prepared.result
        if prepared.choices != 1:
            return "multiple_choices"
        if not live_is_greedy(prepared):
            return "live_sampled"
        if result.original_messages is None or result.original_prompt_tokens <= result.prompt_tokens:
            return "not_compressed"
        if result.original_prompt_tokens > shadow.max_prompt_tokens:
            return "too_long"
        if len(self._tasks) >= shadow.max_in_flight:
            return "in_flight_full"
        if idle_rule and self.load.busy(shadow):
            return "busy"
        return None

    def _drop(self, prepared: Prepared, reason: str) -> None:
        self.metrics.dropped.labels(prepared.policy.name, reason).inc()
        self.ledger.dropped(prepared.tenant.name, prepared.policy.name, reason)

    async def close(self) -> None:
        """Shutdown: running shadow requests are cancelled (and aborted in the engine)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.load.close()

    async def _run(self, live: LiveRun) -> None:
        prepared = live.prepared
        try:
            async with asyncio.timeout(prepared.policy.shadow.timeout_s):
                request = await self._request(live)
                totals = await self._generate(request)
        except _Dropped as exc:
            self._drop(prepared, exc.reason)
            return
        except TimeoutError:
            self._drop(prepared, "timeout")
            return
        except asyncio.CancelledError:
            self._drop(prepared, "shutdown")
            raise
        except EngineError as exc:
            self._drop(prepared, "preempted" if exc.code == SHADOW_PREEMPTED else "engine_error")
            return
        except Exception:
            logger.exception("shadow request for %s failed", prepared.request_id)
            self._drop(prepared, "engine_error")
            return
        await self._record(live, request, totals)

    async def _request(self, live: LiveRun) -> GenerationRequest:
        prepared, generation = live.prepared, live.generation
        shadow = prepared.policy.shadow
        messages = prepared.result.original_messages
        assert messages is not None  # _refusal checked
        tools = (
            prepared.asks.output.tools.template_tools()
            if prepared.asks and prepared.asks.output.tools
            else None
        )
        token_ids, text = await asyncio.to_thread(
            self.prompts.encode_original, messages, tools, generation.model
        )
        max_tokens = shadow.output_tokens or prepared.sampling.max_tokens
        window = self.prompts.access.engine_for(generation.model).max_model_len
        if len(token_ids) > shadow.max_prompt_tokens or len(token_ids) + max_tokens > window:
            raise _Dropped("too_long")
        sampling = replace(
            prepared.sampling, temperature=0.0, n=1, seed=None, logprobs=None, max_tokens=max_tokens
        )
        return replace(
            generation,
            request_id=f"shadow-{prepared.request_id}",
            prompt_token_ids=token_ids,
            sampling=sampling,
            priority=Priority.SHADOW,
            messages=messages,
            prompt_text=text,
            forward=_shadow_forward(prepared.forward),
            route_key=None,
            arrival_time=None,
        )

    async def _generate(self, request: GenerationRequest) -> DeltaTotals:
        totals = DeltaTotals(prompt_tokens=len(request.prompt_token_ids))
        # Closed on every exit (a timeout, shutdown): the engine frees the request's blocks at once.
        async with contextlib.aclosing(self.engine.generate(request)) as stream:
            async for delta in stream:
                totals.add(delta)
        return totals

    async def _record(self, live: LiveRun, request: GenerationRequest, totals: DeltaTotals) -> None:
        prepared = live.prepared
        shadow, policy = prepared.policy.shadow, prepared.policy.name
        agreement = compare(live.answer, totals.text)
        comparison, value = agreement.headline(shadow.comparison)
        model = live.generation.model or self.engine.model_name
        record = ShadowRecord(
            request_id=prepared.request_id,
            tenant=prepared.tenant.name,
            policy=policy,
            model=model,
            comparison=comparison,
            agreement=round(value, 4),
            measures=agreement.as_dict(),
            prompt_tokens_live=prepared.result.prompt_tokens,
            prompt_tokens_shadow=totals.prompt_tokens,
            completion_tokens_live=live.completion_tokens,
            completion_tokens_shadow=totals.completion_tokens,
            live_answer=live.answer[:ANSWER_CHARS],
            shadow_answer=totals.text[:ANSWER_CHARS],
            at=time.time(),
        )
        self.metrics.agreement.labels(policy, prepared.tenant.name, model, comparison).observe(value)
        self.metrics.alert_threshold.labels(policy).set(shadow.alert_below)
        self.metrics.prompt_tokens.labels(policy).inc(totals.prompt_tokens)
        self.metrics.completion_tokens.labels(policy).inc(totals.completion_tokens)
        self.ledger.record(record)
        if self.log is not None:
            hashes = {
                "live": prompt_hash(prepared.prompt_text),
                "shadow": prompt_hash(request.prompt_text or ""),
            }
            try:
                await self.log.write(log_line(record, live.answer, totals.text, hashes))
            except OSError:
                logger.exception("writing the shadow log failed")


def _shadow_forward(forward: dict[str, Any] | None) -> dict[str, Any] | None:
    """An upstream's fields for the shadow request: the client's own (tools, response_format, ...),
    greedy and one choice."""
    if forward is None:
        return None
    return {key: value for key, value in forward.items() if key not in _NOT_SHADOWED} | {"temperature": 0}
