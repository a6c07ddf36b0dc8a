"""The prompt a request sends: its messages and documents compressed to the policy's budget by the
compression pipeline, then rendered with the served model's chat template and counted once more with
its tokenizer (`encode_checked`), so the budget holds whatever the pipeline did.

Client text and retrieved passages are neutralised on the way (`ctxgate.gateway.sanitize`): they
cannot forge control tokens or context markers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ctxgate.backend.openai_api.errors import APIError
from ctxgate.backend.platform.bounded_encode import TextNotTokenizable
from ctxgate.compression.counting import CachedCounter, least_tokens
from ctxgate.compression.store.index_names import UnknownIndexError
from ctxgate.compression.types import (
    BudgetExceededError,
    CompressionInput,
    CompressionResult,
    Document,
    RetrievalSpec,
)
from ctxgate.gateway.access import Access, index_not_found
from ctxgate.gateway.conversation import conversation_key
from ctxgate.gateway.forwarding import forwarded_prompt_tokens
from ctxgate.gateway.keys import Tenant
from ctxgate.gateway.metrics import GatewayMetrics
from ctxgate.gateway.schemas import ChatCompletionRequest, CtxgateExtras
from ctxgate.gateway.segments import BesideMessages, add_beside_messages, check_tools_cap
from ctxgate.gateway.tokenizer_per_model import ModelTokenizers, ModelTokens
from ctxgate.gateway.tools_fit import SHORTENING_STEPS, shortened
from ctxgate.policies.schema import Policy

logger = logging.getLogger(__name__)
_TOOL_FIELDS = ("tool_calls", "tool_call_id")


class Pipeline(Protocol):
    """What the gateway needs of a compressor (ctxgate.compression.pipeline.CompressionPipeline is the one)."""

    async def run(
        self,
        inp: CompressionInput,
        policy: Policy,
        prepare: Callable[[CompressionInput], CompressionInput] | None = None,
        counter: CachedCounter | None = None,
    ) -> CompressionResult:
        """`counter`: what the request's model is counted with (None: the pipeline's own tokenizer)."""
        ...

    def warm_up(self, stopping: threading.Event) -> int:
        """Load the models compression needs and run them once per shape they will meet, so the first
        requests pay for neither; ends early once `stopping` is set. Returns the calls run."""
        ...

    def observe_prefill(self, prompt_tokens: int, prefill_ms: float) -> None:
        """What a prefill of this size cost the engine: compression weighs its own cost against it."""
        ...

    def close(self) -> None: ...


class PromptBuilder:
    def __init__(self, access: Access, tokens: ModelTokenizers, pipeline: Pipeline, metrics: GatewayMetrics):
        self.access = access
        self.tokens = tokens
        self.pipeline = pipeline
        self.metrics = metrics

    async def compress(
        self, body: ChatCompletionRequest, tenant: Tenant, policy: Policy
    ) -> CompressionResult:
        # Client text may not forge control tokens or context markers (gateway/sanitize.py). An
        # upstream also gets each message's other fields (tool_calls, tool_call_id, ...) back.
        # The neutraliser reads the whole request's text: it runs with the compression, off this loop.
        # The built-in engine renders tool-call turns and tool results itself: those fields stay too.
        extra_fields = self.access.engine.forwards_fields
        messages = [
            {"role": m.role, "content": m.text()}
            | ({"name": m.name} if m.name else {})
            | {k: v for k, v in (m.model_extra or {}).items() if extra_fields or k in _TOOL_FIELDS}
            for m in body.messages
        ]
        extras = body.ctxgate or CtxgateExtras()
        documents = [
            Document(text=d.text, id=None if d.id is None else str(d.id), title=d.title, score=d.score)
            for d in extras.documents or []
        ]
        if extras.retrieval:
            self.access.check_index(tenant, extras.retrieval.index)
        retrieval = (
            RetrievalSpec(extras.retrieval.index, extras.retrieval.top_n) if extras.retrieval else None
        )
        # Passages from an index are as untrusted as the client's documents: neutralised the same way.
        tokens = self.tokens.for_model(body.model)
        inp = CompressionInput(
            messages=messages,
            documents=documents,
            retrieval=retrieval,
            tenant=tenant.name,
            neutralise=tokens.neutraliser.document,
            conversation=self.conversation_key(body, tenant, policy),
        )
        try:
            result = await self.pipeline.run(
                inp, policy, prepare=tokens.neutraliser.compression_input, counter=tokens.counter
            )
        except BudgetExceededError as exc:
            self.metrics.budget_rejections.labels(policy.name).inc()
            raise APIError(413, str(exc), param="messages", code="prompt_too_long") from None
        except UnknownIndexError:
            raise index_not_found(retrieval.index if retrieval else "") from None
        except TextNotTokenizable:  # the library's own text (regex internals) stays in the log
            logger.warning("compression input refused by the tokenizer", exc_info=True)
            raise APIError(
                400, "a message or document could not be tokenized", param="messages", code="invalid_value"
            ) from None
        except OSError:  # a server file (an index's parts, a model): its path stays in the log
            logger.exception("compression failed on a server file")
            raise APIError(
                500,
                "the request could not be processed; the server log has the details",
                code="internal_error",
            ) from None
        except (ValueError, KeyError) as exc:
            raise APIError(400, str(exc), code="invalid_request") from None
        for stage in result.stages:
            self.metrics.compression_seconds.labels(stage.name).observe(stage.ms / 1000)
        if policy.compression_enabled:
            self.metrics.compression_wait_seconds.observe(result.wait_ms / 1000)
        return result

    def conversation_key(self, body: ChatCompletionRequest, tenant: Tenant, policy: Policy) -> str | None:
        """The conversation the request continues, where its policy remembers conversations."""
        if not policy.conversation.enabled:
            return None
        conversation_id = body.ctxgate.conversation_id if body.ctxgate else None
        opening: list[dict[str, Any]] = []
        for message in body.messages:  # a long history's later turns are not read
            opening.append({"role": message.role, "content": message.text()})
            if message.role == "user":
                break
        return conversation_key(self.access.cache_salt(tenant.name), opening, conversation_id)

    def encode_checked(
        self,
        result: CompressionResult,
        policy: Policy,
        tools: list[dict[str, Any]] | None = None,
        model: str | None = None,
        forward: dict[str, Any] | None = None,
    ) -> tuple[list[int], str]:
        """Token ids actually sent (with `model`'s tokenizer); re-counted here so the budget holds
        whatever pipeline ran. `forward`: an upstream's fields, whose `tools` and `documents` its
        template adds to the prompt: counted in `result.prompt_tokens` too. Tool definitions over
        `tools.max_tokens` are shortened under `fit.tools: compress` (the forwarded ones in place)."""
        tokens = self.tokens.for_model(model)
        measured = _measure(tokens, result, tools, forward)
        original_tools = measured.beside.tools
        cap = policy.tools.max_tokens
        for step in SHORTENING_STEPS:
            if cap is None or measured.beside.tools <= cap or policy.fit.tools != "compress":
                break
            tools = shortened(tools, step) if tools else None
            if forward is not None and forward.get("tools"):
                forward["tools"] = shortened(forward["tools"], step)
            measured = _measure(tokens, result, tools, forward)
        check_tools_cap(policy, measured.beside.tools)
        token_ids, prompt_text = measured.token_ids, measured.prompt_text
        if len(token_ids) > policy.max_input_tokens:
            logger.error(
                "pipeline produced %d tokens over budget %d", len(token_ids), policy.max_input_tokens
            )
            raise APIError(
                413,
                f"the prompt needs {len(token_ids)} tokens; policy '{policy.name}' allows "
                f"{policy.max_input_tokens}",
                code="prompt_too_long",
            )
        prompt_tokens = len(token_ids) + measured.forwarded
        if prompt_tokens > policy.max_input_tokens:
            raise APIError(
                413,
                f"the prompt with its tools and documents needs {prompt_tokens} tokens; policy "
                f"'{policy.name}' allows {policy.max_input_tokens}",
                code="prompt_too_long",
                param="tools" if forward and forward.get("tools") else "documents",
            )
        add_beside_messages(result, measured.beside, original_tools)
        result.prompt_tokens = prompt_tokens
        return token_ids, prompt_text

    def least_prompt_tokens(self, text: str, model: str | None) -> int:
        """A sound lower bound of `text`'s token count, from its UTF-8 length alone: a prompt over a
        limit by this much is refused without the CPU of tokenizing megabytes."""
        return least_tokens(text, self.tokens.for_model(model).tokenizer.max_token_bytes)

    def encode_original(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, model: str | None
    ) -> tuple[list[int], str]:
        """The uncompressed prompt (`CompressionResult.original_messages`) rendered and tokenized as
        `encode_checked` renders the compressed one, with no budget: a shadow request's prompt."""
        tokens = self.tokens.for_model(model)
        prompt_text = tokens.tokenizer.render_chat(
            messages, tools=tokens.neutraliser.value(tools) if tools else None
        )
        return tokens.tokenizer.encode(prompt_text), prompt_text

    async def encode_prompt(self, text: str, model: str | None) -> list[int]:
        """A raw prompt's ids, tokenized off the event loop (megabytes take a second; /health must not wait)."""
        tokenizer = self.tokens.for_model(model).tokenizer
        try:
            return await asyncio.to_thread(tokenizer.encode, text)
        except TextNotTokenizable:
            logger.warning("prompt refused by the tokenizer", exc_info=True)
            raise APIError(
                400, "prompt could not be tokenized", param="prompt", code="invalid_value"
            ) from None


@dataclass(frozen=True)
class _Measured:
    """A prompt rendered with its tools: its ids and text, what it holds beside the messages, and the
    tokens an upstream's template adds for the forwarded fields."""

    token_ids: list[int]
    prompt_text: str
    beside: BesideMessages
    forwarded: int


def _measure(
    tokens: ModelTokens,
    result: CompressionResult,
    tools: list[dict[str, Any]] | None,
    forward: dict[str, Any] | None,
) -> _Measured:
    # Tools are client text the template prints: inert like the messages (which the pipeline cleaned).
    prompt_text = tokens.tokenizer.render_chat(
        result.messages, tools=tokens.neutraliser.value(tools) if tools else None
    )
    token_ids = tokens.tokenizer.encode(prompt_text)
    forwarded = forwarded_prompt_tokens(forward, tokens.tokenizer)
    # `result.prompt_tokens` is still the pipeline's exact count of the messages alone.
    beside = BesideMessages(
        tools=len(token_ids) - result.prompt_tokens + forwarded.get("tools", 0),
        documents=forwarded.get("documents", 0),
    )
    return _Measured(token_ids, prompt_text, beside, sum(forwarded.values()))
