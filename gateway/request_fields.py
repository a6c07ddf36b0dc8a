"""The request's fields against the engine that serves its model: what the built-in engine honours
(or drops, under drop_params), what goes on to an upstream, how many sequences it makes, and its
sampling parameters."""

from __future__ import annotations

from typing import Any

from ctxgate.backend.engine.api import SamplingParams
from ctxgate.backend.openai_api.errors import APIError
from ctxgate.backend.openai_api.fields import enforce_supported
from ctxgate.backend.openai_api.request_params import EngineAsks
from ctxgate.gateway.access import Access
from ctxgate.gateway.forwarding import forwarded_fields
from ctxgate.gateway.schemas import ChatCompletionRequest, GatewayRequest
from ctxgate.gateway.tokenizer_per_model import ModelTokenizers
from ctxgate.policies.schema import Policy

# Most sequences one upstream request may make (`n`, `best_of`), as OpenAI's own limit on `n`.
MAX_CHOICES = 128


class RequestFields:
    def __init__(self, access: Access, tokens: ModelTokenizers, drop_params: bool):
        self.access = access
        self.tokens = tokens
        # The server's --drop-params; a policy's drop_params adds to it.
        self.drop_params = drop_params

    # -- request fields --------------------------------------------------------------------------
    def check_fields(
        self, body: GatewayRequest, policy: Policy, raw: dict[str, Any] | None
    ) -> tuple[list[str], dict[str, Any] | None]:
        """(dropped field names, fields to forward). The built-in engine refuses (400) what it cannot
        honour unless drop_params; an upstream gets the allow-listed part of the client's body
        (`ctxgate.gateway.forwarding`), the rest dropped and named."""
        if self.access.engine_for(body.model).forwards_fields:
            fields = dict(raw) if raw is not None else body.model_dump(exclude_unset=True)
            forwarded = forwarded_fields(
                fields, isinstance(body, ChatCompletionRequest), self.tokens.for_model(body.model).neutraliser
            )
            return forwarded.dropped, forwarded.fields
        return enforce_supported(body, policy.drop_params or self.drop_params), None

    def choices_for(self, body: GatewayRequest, forward: dict[str, Any] | None) -> int:
        """How many sequences the request makes, each up to max_tokens, all of them reserved: the
        built-in engine makes n; an upstream makes max(n, best_of)."""
        best_of = forward.get("best_of") if forward is not None else None
        if best_of is not None and (isinstance(best_of, bool) or not isinstance(best_of, int) or best_of < 1):
            raise APIError(400, "best_of must be a positive integer", param="best_of", code="invalid_value")
        choices = max(body.n, best_of or 1)
        if choices > MAX_CHOICES:
            field = "n" if body.n >= (best_of or 1) else "best_of"
            raise APIError(
                400,
                f"{field} may be at most {MAX_CHOICES} (each choice is reserved against the quota)",
                param=field,
                code="unsupported_parameter",
            )
        return choices

    def sampling_for(
        self, body: GatewayRequest, policy: Policy, prompt_tokens: int, asks: EngineAsks | None = None
    ) -> SamplingParams:
        requested = body.requested_max_tokens()
        room = self.access.engine_for(body.model).max_model_len - prompt_tokens
        max_tokens = min(requested or policy.reserve_output_tokens, policy.reserve_output_tokens, room)
        if max_tokens < 1:
            raise APIError(
                413, "the prompt leaves no room for output in the model's context", code="prompt_too_long"
            )
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            min_tokens=min(body.min_tokens, max_tokens),
            **(asks.sampling if asks else {}),
        )
        try:
            sampling.validate()
        except ValueError as exc:
            raise APIError(400, str(exc), param=getattr(exc, "param", None), code="invalid_value") from None
        return sampling
