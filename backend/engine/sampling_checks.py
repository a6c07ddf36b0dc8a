"""What the engine admits: every per-request field the sampler, the grammar and the stop logic read.

A request's fields are attacker-controlled, and the engine batches every tenant's sequences into one
step: a value that makes a tensor op raise (a token id past the vocabulary, an integer past int64, a
NaN temperature) would fail the step for everyone. So each field is checked once, when the request
is added, against the model it runs on; the step itself then never re-checks (the hot path stays
free of per-token validation). A refusal names the client's field.
"""

from __future__ import annotations

import math
from dataclasses import replace
from numbers import Real
from typing import TYPE_CHECKING

from ctxgate.backend.engine.api import MAX_LOGIT_BIAS, MAX_N, MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from ctxgate.backend.engine.api import SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_SEQUENCES = 16  # as the OpenAI API's limit on `stop` (4), with room for vLLM clients
# Each step walks a sequence's stop token ids while it is under min_tokens, and each sampled token
# is looked up in them: a list as long as the vocabulary would slow every tenant's step.
MAX_STOP_TOKEN_IDS = 256


class SamplingParamError(ValueError):
    """A sampling field no engine accepts; `param` is the client's name for it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_sampling(params: SamplingParams, vocab_size: int | None = None) -> None:
    """Raise SamplingParamError naming the first invalid field. With `vocab_size`, token ids are
    checked against the model's vocabulary too (the gateway checks without it, the engine with)."""
    _check_sizes(params)
    _check_floats(params)
    _check_token_ids(params, vocab_size)
    if params.guide is not None and vocab_size is not None and params.guide.vocab_size > vocab_size:
        raise SamplingParamError(
            f"the output grammar was compiled for a {params.guide.vocab_size}-token vocabulary; this model "
            f"has {vocab_size}",
            "response_format",
        )


def admitted(params: SamplingParams, vocab_size: int, max_num_seqs: int) -> SamplingParams:
    """`params` checked against the model, as the engine runs them: a top_k at or past the
    vocabulary keeps every token, so it is stored as 0 (off), which no tensor can overflow on."""
    check_sampling(params, vocab_size)
    if params.n > max_num_seqs:
        raise SamplingParamError(f"n must be at most {max_num_seqs} (the engine's max_num_seqs)", "n")
    if params.top_k >= vocab_size:
        return replace(params, top_k=0)
    return params


def _int(value: object, name: str, low: int, high: int, what: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SamplingParamError(f"{name} must be an integer {what or f'between {low} and {high}'}", name)
    return value


def _check_sizes(params: SamplingParams) -> None:
    _int(params.max_tokens, "max_tokens", 1, INT64_MAX, "of at least 1")
    _int(
        params.min_tokens,
        "min_tokens",
        0,
        params.max_tokens,
        f"between 0 and max_tokens ({params.max_tokens})",
    )
    _int(params.top_k, "top_k", 0, math.inf, "of at least 0 (0 disables top-k)")  # type: ignore[arg-type]
    _int(params.n, "n", 1, MAX_N)
    if params.seed is not None:
        _int(params.seed, "seed", INT64_MIN, INT64_MAX, "in the int64 range")
    if params.logprobs is not None:
        _int(params.logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if not isinstance(params.stop, list) or len(params.stop) > MAX_STOP_SEQUENCES:
        raise SamplingParamError(f"stop may hold at most {MAX_STOP_SEQUENCES} sequences", "stop")
    if not all(isinstance(stop, str) for stop in params.stop):
        raise SamplingParamError("stop sequences must be strings", "stop")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise SamplingParamError(
            f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids"
        )
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise SamplingParamError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens", "logit_bias")


def _float(value: object, name: str, low: float, high: float, what: str) -> None:
    # NaN fails every comparison and infinity overflows the sampler's arithmetic: finite only.
    finite = isinstance(value, Real) and not isinstance(value, bool) and _is_finite(value)
    if not finite or not low <= value <= high:  # type: ignore[operator]
        raise SamplingParamError(f"{name} must be a finite number {what}", name)


def _is_finite(value: Real) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range
        return False


def _check_floats(params: SamplingParams) -> None:
    _float(params.temperature, "temperature", 0.0, math.inf, ">= 0")
    _float(params.top_p, "top_p", math.ulp(0.0), 1.0, "in (0, 1]")
    _float(params.min_p, "min_p", 0.0, 1.0, "in [0, 1]")
    _float(params.presence_penalty, "presence_penalty", -2.0, 2.0, "between -2 and 2")
    _float(params.frequency_penalty, "frequency_penalty", -2.0, 2.0, "between -2 and 2")
    _float(params.repetition_penalty, "repetition_penalty", math.ulp(0.0), 10.0, "in (0, 10]")
    for bias in params.logit_bias.values():
        _float(bias, "logit_bias", -100.0, 100.0, "between -100 and 100 for each token")


def _check_token_ids(params: SamplingParams, vocab_size: int | None) -> None:
    high = INT64_MAX if vocab_size is None else vocab_size - 1
    what = "in the int64 range" if vocab_size is None else f"in [0, {vocab_size}) (this model's vocabulary)"
    for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
        for token in tokens:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= high:
                raise SamplingParamError(f"{name} must name token ids {what}; got {_short(token)}", name)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."
