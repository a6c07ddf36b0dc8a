"""What a request can cost at most, known before any of its expensive work.

Compression, grammar compilation and tokenization of a large prompt are the costly parts of a
request; the quota is checked before all of them (`Accounting.check_quota_first`), so a tenant whose
quota is spent costs a dictionary or Redis lookup, not a second of shared CPU. The amount checked is
what the request can be charged at its largest: its prompt never exceeds the policy's
`max_input_tokens` (it is refused with 413 otherwise), nor, but for the chat template's framing, the
UTF-8 bytes of the text it brings (a byte-level BPE or tiktoken token is at least one byte); its
output is at most `max_tokens` per choice. The exact reservation after compression, with the
prompt's real count, still decides and is what is reconciled: this check only refuses early a
request the tenant's quota has no room for at that size, typically a large document from a tenant
with little quota left, or any request from one with none.
"""

from __future__ import annotations

from ctxgate.gateway.schemas import ChatCompletionRequest, GatewayRequest
from ctxgate.policies.schema import Policy


def _utf8_bytes(text: str | None) -> int:
    return len(text.encode("utf-8", "surrogatepass")) if text else 0


def client_text_bytes(body: GatewayRequest) -> int:
    """UTF-8 bytes of the text the request brings (messages, documents, prompt): linear, no tokenizer."""
    if not isinstance(body, ChatCompletionRequest):
        return _utf8_bytes(body.prompt_text())
    total = sum(_utf8_bytes(message.text()) + _utf8_bytes(message.name) for message in body.messages)
    extras = body.ctxgate
    for document in (extras.documents if extras else None) or []:
        total += _utf8_bytes(document.text) + _utf8_bytes(document.title)
    return total


def prompt_token_bound(body: GatewayRequest, policy: Policy) -> int:
    """The most prompt tokens the request can be charged for (at least 1)."""
    extras = body.ctxgate if isinstance(body, ChatCompletionRequest) else None
    if extras is not None and extras.retrieval is not None:
        return policy.max_input_tokens  # passages come from the index: only the budget bounds them
    return max(1, min(policy.max_input_tokens, client_text_bytes(body)))


def output_token_bound(body: GatewayRequest, policy: Policy, choices: int) -> int:
    """The most output tokens the request can reserve: what `RequestFields.sampling_for` can grant, per choice."""
    requested = body.requested_max_tokens()
    return min(requested or policy.reserve_output_tokens, policy.reserve_output_tokens) * choices
