"""What an upstream server gets of the client's own fields (upstream mode).

The gateway budgets, reserves and neutralises the prompt it renders; a field the upstream would add
to the prompt behind its back (vLLM's `documents`, `tools`), or that re-renders it (`chat_template`,
`chat_template_kwargs`, `add_generation_prompt`, ...), would escape all three. So the fields that go
on are an explicit allow-list: sampling and output fields are forwarded as they are; `tools` and
`documents` are neutralised like messages and counted in the prompt's tokens (max_input_tokens and
the quota reservation); the gateway's own fields (`ctxgate.backend.routing.upstream.GATEWAY_OWNED`) are set by it;
everything else is dropped and named in `usage.ctxgate.dropped_params`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from ctxgate.backend.openai_api.errors import APIError
from ctxgate.backend.routing.upstream import GATEWAY_OWNED
from ctxgate.gateway.sanitize import Neutraliser

# Fields that shape sampling or the output format, not the prompt (OpenAI's, and vLLM's extras).
_SAMPLING = frozenset(
    """temperature top_p top_k min_p n best_of seed presence_penalty frequency_penalty repetition_penalty
    length_penalty logit_bias logprobs stop_token_ids ignore_eos min_tokens include_stop_str_in_output
    skip_special_tokens spaces_between_special_tokens response_format guided_json guided_regex guided_choice
    guided_grammar guided_decoding_backend guided_whitespace_pattern structured_outputs user metadata store
    service_tier prediction""".split()
)
_CHAT = _SAMPLING | {"top_logprobs", "tool_choice", "parallel_tool_calls", "reasoning_effort", "modalities"}
_COMPLETION = _SAMPLING | {"echo"}
# Rendered into the prompt by the upstream's chat template: neutralised and counted here.
PROMPT_FIELDS = ("tools", "documents")


@dataclass
class Forwarded:
    """The fields to send on, and the names of those dropped (sorted)."""

    fields: dict[str, Any]
    dropped: list[str] = field(default_factory=list)


class TextEncoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def forwarded_fields(raw: dict[str, Any], chat: bool, neutraliser: Neutraliser) -> Forwarded:
    """The allow-listed part of a client's body. Gateway-owned fields are kept (the upstream client
    sets them itself) and are not reported as dropped."""
    allowed = _CHAT if chat else _COMPLETION
    fields: dict[str, Any] = {}
    dropped: list[str] = []
    for name, value in raw.items():
        if name in GATEWAY_OWNED or name in allowed:
            fields[name] = value
        elif chat and name in PROMPT_FIELDS:
            fields[name] = neutraliser.value(_list_of_objects(name, value))
        else:
            dropped.append(name)
    if "tool_choice" in fields:  # names a function, which some templates print
        fields["tool_choice"] = neutraliser.value(fields["tool_choice"])
    return Forwarded(fields, sorted(dropped))


def _list_of_objects(name: str, value: Any) -> list[Any]:
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise APIError(400, f"{name} must be a list of objects", param=name, code="invalid_value")
    return value


def forwarded_prompt_tokens(forward: dict[str, Any] | None, tokenizer: TextEncoder) -> dict[str, int]:
    """Tokens the upstream's template adds for `tools` and `documents`, per field: each one's JSON,
    counted with the model's tokenizer (the template's own framing around them is small and not
    counted). Empty when neither is sent."""
    if not forward:
        return {}
    return {
        name: len(tokenizer.encode(json.dumps({name: forward[name]}, ensure_ascii=False)))
        for name in PROMPT_FIELDS
        if forward.get(name)
    }
