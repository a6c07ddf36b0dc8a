"""Per-segment accounting at the gateway: `usage.ctxgate.segments`, the per-segment cost and the
`ctxgate:segment_tokens_*` counters.

The compression pipeline splits the messages' prompt into system, history, documents and question
(ctxgate.compression.segments); the gateway adds what the prompt holds beside the messages: the
tool definitions the chat template renders, and in upstream mode the `tools` and `documents` it
forwards. Output is the completion. Each side adds up exactly to its count: `before` to
original_prompt_tokens, `after` to prompt_tokens (the engine's or upstream's own count where it
reports one), output to completion_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ctxgate.backend.openai_api.errors import APIError
from ctxgate.compression.segments import PROMPT_SEGMENTS, balanced
from ctxgate.compression.types import CompressionResult
from ctxgate.gateway.metrics import GatewayMetrics
from ctxgate.policies.schema import Policy

SEGMENTS: tuple[str, ...] = (*PROMPT_SEGMENTS, "output")


@dataclass(frozen=True)
class BesideMessages:
    """Prompt tokens outside the messages: tool definitions (rendered by the template or forwarded
    to an upstream) and documents forwarded to an upstream's template."""

    tools: int = 0
    documents: int = 0

    @property
    def total(self) -> int:
        return self.tools + self.documents


def add_beside_messages(result: CompressionResult, beside: BesideMessages, original_tools: int) -> None:
    """Count what the prompt holds beside its messages in both sides' segments and in the original
    prompt (the sent prompt's count is set by the caller, which measured it whole). Forwarded
    documents are never compressed; tool definitions only when shortened to fit their cap
    (`original_tools`: before that)."""
    for counts, tools in ((result.segments_original, original_tools), (result.segments_sent, beside.tools)):
        if counts:
            counts["tools"] = counts.get("tools", 0) + tools
            counts["documents"] = counts.get("documents", 0) + beside.documents
    result.original_prompt_tokens += original_tools + beside.documents


def check_tools_cap(policy: Policy, tools_tokens: int) -> None:
    """413 naming the tools segment when the tool definitions are over the policy's `tools.max_tokens`."""
    cap = policy.tools.max_tokens
    if cap is not None and tools_tokens > cap:
        raise APIError(
            413,
            f"the tool definitions take {tools_tokens} tokens; policy '{policy.name}' allows "
            f"{cap} (tools.max_tokens)",
            param="tools",
            code="tools_too_long",
        )


def prompt_segments(result: CompressionResult, prompt_tokens: int | None = None) -> dict[str, dict[str, int]]:
    """Before and after per prompt segment (the `/v1/ctxgate/compress` report's `segments`), the
    after side adding up to `prompt_tokens` (default: the gateway's count). A prompt the pipeline
    did not describe (a raw completions prompt) is all question."""
    before = balanced(
        result.segments_original or {"question": result.original_prompt_tokens},
        result.original_prompt_tokens,
    )
    sent = result.prompt_tokens if prompt_tokens is None else prompt_tokens
    after = balanced(result.segments_sent or {"question": result.prompt_tokens}, sent)
    return {name: {"before": before[name], "after": after[name]} for name in PROMPT_SEGMENTS}


def usage_segments(
    result: CompressionResult, prompt_tokens: int, completion_tokens: int
) -> dict[str, dict[str, int]]:
    """`usage.ctxgate.segments`: `prompt_segments` at the model's own prompt count, and the output."""
    output = {"before": completion_tokens, "after": completion_tokens}
    return prompt_segments(result, prompt_tokens) | {"output": output}


def segment_costs(policy: Policy, segments: dict[str, dict[str, int]]) -> dict[str, float]:
    """What each segment cost at the policy's prices (prompt segments at the prompt price, output at
    the completion price), each rounded as the totals are."""
    prices = {name: policy.cost.prompt_per_1k for name in PROMPT_SEGMENTS} | {
        "output": policy.cost.completion_per_1k
    }
    return {name: round(segments[name]["after"] / 1000 * prices[name], 8) for name in SEGMENTS}


def count_segments(
    metrics: GatewayMetrics, tenant: str, policy: str, segments: dict[str, dict[str, Any]]
) -> None:
    for name in SEGMENTS:
        metrics.segment_tokens_original.labels(tenant, policy, name).inc(segments[name]["before"])
        metrics.segment_tokens_sent.labels(tenant, policy, name).inc(segments[name]["after"])
