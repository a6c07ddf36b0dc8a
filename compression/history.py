"""History summarization: oldest turns become a rolling summary; the last turns stay verbatim.

Rolling: the summary covering turns[:k] is cached (per tenant) under a hash of those k turns. A new
request looks for the longest cached prefix and only summarizes the turns after it, so each turn
goes through the LLM once per conversation. The LLM call runs at background priority with a timeout;
on timeout, a refused call, a saturated engine or no engine, an extractive summary (the sentences
most related to the question, within the summary budget) takes its place. A tenant has at most one
LLM summary in flight: the engine work a tenant can start without paying for it is one background
sequence, however many requests with fresh histories it sends at once; the others get the extractive
summary at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ctxgate.compression.counting import ChatTokenizer
from ctxgate.compression.knapsack import knapsack
from ctxgate.compression.scoring import lexical_overlap, values_from_scores
from ctxgate.compression.state import message_text
from ctxgate.compression.store.cache import BytesCache

if TYPE_CHECKING:
    from ctxgate.backend.engine.api import GenerationDelta, GenerationRequest

logger = logging.getLogger(__name__)

DEFAULT_MODEL_LEN = 2048  # an engine that reports no context window is assumed to have this one


class SummaryEngine(Protocol):
    """What compression uses of an engine: background generation of history summaries, whose
    prompts must fit its context window. `ctxgate.backend.engine.api.EngineClient` has all of it."""

    @property
    def max_model_len(self) -> int: ...

    def is_ready(self) -> bool: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]: ...

    async def abort(self, request_id: str) -> None: ...


SUMMARIZER_SYSTEM_PROMPT = (
    "You write short summaries of conversations. Keep names, numbers, facts, decisions and open "
    "questions. Write plain sentences, no preamble."
)


TOOL_ROLES = ("tool", "function")


def calls_tools(message: dict[str, Any]) -> bool:
    """An assistant turn that asks for tool calls (or a legacy function call)."""
    return message.get("role") == "assistant" and bool(
        message.get("tool_calls") or message.get("function_call")
    )


def turn_units(turns: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """The history as units that are kept, summarized or dropped whole, as [start, end) spans: an
    assistant turn with `tool_calls` together with the `tool` replies after it (a reply without its
    call, or a call without its replies, is a broken conversation: an OpenAI-style server refuses
    it), every other turn on its own. A tool reply with no call before it stays with the turn
    before it, so no cut ever makes it the first message."""
    units: list[tuple[int, int]] = []
    for index, turn in enumerate(turns):
        if turn.get("role") in TOOL_ROLES and units:
            units[-1] = (units[-1][0], index + 1)
        else:
            units.append((index, index + 1))
    return units


def is_tool_unit(turns: list[dict[str, Any]], unit: tuple[int, int]) -> bool:
    """A unit holding a tool exchange: kept verbatim, never summarized."""
    return any(calls_tools(turn) or turn.get("role") in TOOL_ROLES for turn in turns[unit[0] : unit[1]])


def turns_key(tenant: str, turns: list[dict[str, Any]]) -> str:
    digest = hashlib.sha256()
    for turn in turns:
        digest.update(json.dumps([turn.get("role"), message_text(turn)], ensure_ascii=False).encode())
        digest.update(b"\x1e")
    return f"summary:{hashlib.sha256(tenant.encode()).hexdigest()[:16]}:{digest.hexdigest()}"


def transcript(turns: list[dict[str, Any]]) -> str:
    return "\n".join(f"{turn.get('role', 'user')}: {message_text(turn)}" for turn in turns)


@dataclass
class SummaryOutcome:
    text: str
    source: str  # "cache" | "engine" | "extractive"
    engine_calls: int = 0
    covered_turns: int = 0


class HistorySummarizer:
    def __init__(
        self,
        count: Callable[[str], int],
        split_sentences: Callable[[str], list[str]],
        cache: BytesCache,
        engine: SummaryEngine | None = None,
        tokenizer: ChatTokenizer | None = None,
    ):
        self.count = count
        self.split_sentences = split_sentences
        self.cache = cache
        self.engine = engine
        self.tokenizer = tokenizer
        self.engine_calls = 0
        self._summarizing: set[str] = set()  # tenants with an LLM summary in flight
        self._summarizing_lock = threading.Lock()  # compression workers call from their own threads

    async def summarize(
        self,
        tenant: str,
        turns: list[dict[str, Any]],
        question: str,
        max_tokens: int,
        timeout_s: float,
        use_engine: bool = True,
    ) -> SummaryOutcome:
        if not turns or max_tokens <= 0:
            return SummaryOutcome("", "extractive")
        cached = self.cache.get(turns_key(tenant, turns))
        if cached is not None:
            return SummaryOutcome(self._fit(cached.decode(), max_tokens), "cache", covered_turns=len(turns))
        engine = self._ready_engine() if use_engine else None
        if engine is not None and self._claim(tenant):
            try:
                text, calls = await asyncio.wait_for(
                    self._rolling_summary(engine, tenant, turns, max_tokens), timeout=timeout_s
                )
                return SummaryOutcome(self._fit(text, max_tokens), "engine", calls, len(turns))
            except TimeoutError:
                logger.info("history summary timed out after %.2fs; extractive fallback", timeout_s)
            except Exception as exc:  # engine refused (saturated, too long...): never fail the request
                logger.warning("history summary failed (%s); extractive fallback", exc)
            finally:
                self._release(tenant)
        return SummaryOutcome(self.extractive(turns, question, max_tokens), "extractive", 0, len(turns))

    def _claim(self, tenant: str) -> bool:
        """The tenant's one LLM summary slot; False while another of its summaries is in flight."""
        with self._summarizing_lock:
            if tenant in self._summarizing:
                return False
            self._summarizing.add(tenant)
            return True

    def _release(self, tenant: str) -> None:
        with self._summarizing_lock:
            self._summarizing.discard(tenant)

    def _ready_engine(self) -> SummaryEngine | None:
        """The engine, when there is one and it is ready (a failing readiness probe is not)."""
        engine = self.engine
        if engine is None:
            return None
        try:
            return engine if engine.is_ready() else None
        except Exception:
            return None

    async def _rolling_summary(
        self, engine: SummaryEngine, tenant: str, turns: list[dict[str, Any]], max_tokens: int
    ) -> tuple[str, int]:
        covered, summary = 0, ""
        for prefix_length in range(len(turns) - 1, 0, -1):
            cached = self.cache.get(turns_key(tenant, turns[:prefix_length]))
            if cached is not None:
                covered, summary = prefix_length, cached.decode()
                break
        calls = 0
        input_limit = self._input_token_limit(engine, max_tokens)
        while covered < len(turns):
            chunk_end = covered + 1
            while (
                chunk_end < len(turns)
                and self.count(transcript(turns[covered : chunk_end + 1])) <= input_limit
            ):
                chunk_end += 1
            summary = await self._call_engine(
                engine, tenant, summary, turns[covered:chunk_end], max_tokens, input_limit
            )
            calls += 1
            covered = chunk_end
            self.cache.set(turns_key(tenant, turns[:covered]), summary.encode())
        return summary, calls

    @staticmethod
    def _input_token_limit(engine: SummaryEngine, max_tokens: int) -> int:
        model_limit = int(engine.max_model_len or DEFAULT_MODEL_LEN)
        return max(64, model_limit - max_tokens - 2 * max_tokens - 96)  # room for template + old summary

    @staticmethod
    def salt(tenant: str) -> str:
        """The summary requests' prefix-cache namespace for `tenant` (clients never choose a salt:
        the gateway sets its own on every request it forwards)."""
        return hashlib.sha256(f"ctxgate-summary\x1f{tenant}".encode()).hexdigest()

    async def _call_engine(
        self,
        engine: SummaryEngine,
        tenant: str,
        previous: str,
        turns: list[dict[str, Any]],
        max_tokens: int,
        input_limit: int,
    ) -> str:
        from ctxgate.backend.engine.api import GenerationRequest, Priority, SamplingParams

        conversation = transcript(turns)
        if self.count(conversation) > input_limit:  # one huge turn: summarize its most relevant head
            conversation = self.extractive(turns, "", input_limit)
        prompt = f"Conversation:\n{conversation}\n\nWrite a summary of the conversation in at most {max_tokens // 2 + 4} words."
        if previous:
            prompt = f"Summary so far:\n{previous}\n\n{prompt} Include what the summary so far says."
        messages = [
            {"role": "system", "content": SUMMARIZER_SYSTEM_PROMPT},
            {"role": "user", "content": prompt},
        ]
        # No ids (no tokenizer, or no local chat template): the engine tokenizes the messages.
        prompt_ids = (self.tokenizer.encode_chat(messages) if self.tokenizer is not None else None) or []
        request = GenerationRequest(
            request_id=f"ctxgate-summary-{uuid.uuid4().hex[:12]}",
            prompt_token_ids=prompt_ids,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            priority=Priority.BACKGROUND,
            messages=messages,
            # Per tenant: tenants never share (or time) each other's cached summary prompts.
            cache_salt=self.salt(tenant),
            tenant=tenant,  # the summary is the tenant's prefill: it spends the tenant's fair share
        )
        self.engine_calls += 1
        pieces: list[str] = []
        finished = False
        try:
            async for delta in engine.generate(request):
                pieces.append(delta.text)
                if delta.finish_reason is not None:
                    finished = True
                    if delta.finish_reason == "abort":
                        raise RuntimeError("summary request aborted by the engine")
        finally:
            if not finished:
                try:
                    await engine.abort(request.request_id)
                except Exception:
                    pass
        text = "".join(pieces).strip()
        if not text:
            raise RuntimeError("engine returned an empty summary")
        return text

    def _fit(self, text: str, max_tokens: int) -> str:
        """A summary longer than its budget loses its last sentences (then words)."""
        if self.count(text) <= max_tokens:
            return text
        sentences = self.split_sentences(text)
        while sentences and self.count(" ".join(sentences)) > max_tokens:
            sentences.pop()
        if sentences:
            return " ".join(sentences)
        words = text.split()
        while words and self.count(" ".join(words)) > max_tokens:
            words = words[: max(0, len(words) * 3 // 4)]
        return " ".join(words)

    def extractive(self, turns: list[dict[str, Any]], question: str, max_tokens: int) -> str:
        """The sentences of old turns most related to the question (and recent), in original order."""
        units: list[tuple[int, str]] = []
        for turn_index, turn in enumerate(turns):
            role = turn.get("role", "user")
            for sentence in self.split_sentences(message_text(turn)):
                units.append((turn_index, f"{role}: {sentence}"))
        if not units or max_tokens <= 0:
            return ""
        overlap = lexical_overlap(question, [text for _, text in units]) if question else np.zeros(len(units))
        recency = np.array([(turn_index + 1) / len(turns) for turn_index, _ in units])
        values = values_from_scores(0.7 * overlap + 0.3 * recency)
        costs = [self.count(text) + 1 for _, text in units]
        chosen = knapsack(list(values), costs, max_tokens)
        return self._fit("\n".join(units[i][1] for i in chosen), max_tokens)
