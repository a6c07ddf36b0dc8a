"""The engine's public, device-free interface: what the gateway and benchmarks program against.

Both the in-process engine (`ctxgate.backend.engine.async_engine.AsyncEngine`) and the upstream HTTP clients
(`ctxgate.backend.routing.upstream`) implement `EngineClient`, so the gateway never knows which one it talks to.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # type-only: this module stays free of the tokenizer and metrics libraries
    from prometheus_client import CollectorRegistry

    from ctxgate.backend.engine.guided import Guide
    from ctxgate.backend.model.tokenizer import Tokenizer

MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's limit
MAX_LOGIT_BIAS = 300  # biased tokens per request
MAX_TENANT_WEIGHT = 1000.0  # a tenant's fair-queuing weight; 1 is the default share


class Priority(enum.IntEnum):
    """Lower value is scheduled first; FCFS within one class."""

    USER = 0
    BACKGROUND = 1  # e.g. history summarization
    # A gateway's quality check (the uncompressed prompt of a live request): admitted only behind every
    # other request, preempted first when one needs room, and then dropped, never recomputed.
    SHADOW = 2


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's min_tokens: until this many tokens are out, EOS and stop_token_ids cannot be sampled.
    min_tokens: int = 0
    n: int = 1  # choices, all sharing the prompt's KV blocks
    presence_penalty: float = 0.0  # OpenAI's: minus this from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # vLLM's: divides positive (multiplies negative) logits of seen tokens
    min_p: float = 0.0  # drop tokens below min_p times the top token's probability
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # None: no log probabilities; k >= 0: the sampled token's and the k most likely alternatives'.
    logprobs: int | None = None
    guide: Guide | None = None  # a compiled grammar the output must follow (ctxgate.backend.engine.guided)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError (`ctxgate.backend.engine.sampling_checks.SamplingParamError`, naming the field) for values no
        engine accepts; with `vocab_size`, token ids are checked against the model's vocabulary."""
        from ctxgate.backend.engine.sampling_checks import check_sampling

        check_sampling(self, vocab_size)

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: Priority = Priority.USER
    # Prefix-cache namespace: requests with different salts never share cached KV blocks.
    cache_salt: str | None = None
    # Upstream HTTP clients may forward the chat messages or rendered prompt instead of token ids
    # (a remote engine tokenizes with its own tokenizer); the in-process engine uses the ids.
    messages: list[dict] | None = None
    prompt_text: str | None = None
    # The client's own request fields that the gateway does not rewrite (tools, response_format,
    # logprobs, vendor extras, ...): an engine that `forwards_fields` sends them on untouched and
    # relays its server's chunks (`GenerationDelta.raw`); other engines never see them.
    forward: dict[str, Any] | None = None
    # time.perf_counter() when the request was handed to the engine. The async engine stamps it on
    # submission: a request that waits for the step in progress to end is queued, and its queue time
    # and TTFT say so. None: the moment the engine takes the request.
    arrival_time: float | None = None
    # A model list (ctxgate.backend.routing.model_router): the served model name that picks the group, and the key of
    # the prompt's stable prefix that cache-affinity routing hashes (None: nothing worth keeping).
    model: str | None = None
    route_key: str | None = None
    # The served model names the caller's key may use (None: any): fallbacks outside it are skipped.
    allowed_models: frozenset[str] | None = None
    # Fair queuing (ctxgate.backend.engine.fair_queue): whose share of the engine's prefill tokens this
    # request spends (None: the unnamed tenant every such request shares) and that tenant's weight,
    # in (0, MAX_TENANT_WEIGHT].
    tenant: str | None = None
    weight: float = 1.0


@dataclass
class RequestMetrics:
    """Timings measured by the engine for one request (milliseconds)."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    e2e_ms: float = 0.0
    cached_prompt_tokens: int = 0
    preemptions: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability and its most likely alternatives (raw model output)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class GenerationDelta:
    """One streamed increment of choice `index`. The request's final delta has `finish_reason` set
    and carries metrics; with several choices, each choice's last delta has `choice_finish_reason`."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort": the whole request ended
    index: int = 0  # the choice (n > 1)
    choice_finish_reason: str | None = None  # this choice ended (None on engines without choices)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked
    prompt_tokens: int = 0
    completion_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Forwarding engines only: the server's chunk as received (relayed to the client as it is) and,
    # on the final delta, the server's own `usage` object.
    raw: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None


# `EngineError.code` of a shadow request the scheduler dropped to make room for real work.
SHADOW_PREEMPTED = "shadow_preempted"


class EngineError(Exception):
    """Raised for requests the engine refuses; `status_code` maps it to HTTP."""

    def __init__(
        self, message: str, status_code: int = 400, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status_code = status_code
        # What an upstream server said was wrong, kept so the client still learns which field.
        self.param = param
        self.code = code


def check_weight(weight: float) -> None:
    """Raise EngineError (400, naming `weight`) unless `weight` is a finite number in (0, MAX_TENANT_WEIGHT]."""
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= MAX_TENANT_WEIGHT:
        raise EngineError(
            f"weight must be a number above 0 and at most {MAX_TENANT_WEIGHT:g}",
            400,
            param="weight",
            code="invalid_value",
        )


class SideWorkRunner(Protocol):
    def run_between_steps(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn()` on the engine's thread before its next step (or between two layers of the
        step in progress); the future holds its result or exception."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """Everything the gateway and the compression pipeline use of an engine, in-process or remote."""

    model_name: str
    max_model_len: int
    # The compute path serving (device, dtype, CPU kernels, matmul dispatch; see
    # ctxgate.backend.platform.cpu_features); None when the engine does not say (a non-ctxgate upstream).
    path_info: dict[str, object] | None

    @property
    def forwards_fields(self) -> bool:
        """True for engines that forward the client's request fields to another server
        (`GenerationRequest.forward`) instead of honouring them here."""
        ...

    @property
    def groups(self) -> Mapping[str, EngineClient]:
        """A model list: each model this client serves, by served name, with its own client (its context
        length, whether it forwards fields). Empty for an engine that serves one model."""
        ...

    @property
    def side_work(self) -> SideWorkRunner | None:
        """Where other components may run CPU work on the engine's own thread; None when the engine
        has no such place (a remote server, a GPU engine)."""
        ...

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The engine's own tokenizer; None when it tokenizes remotely (the gateway then loads one)."""
        ...

    @property
    def metrics_registry(self) -> CollectorRegistry | None:
        """Engine metrics the gateway re-exports on its `/metrics`; None when there are none here."""
        ...

    @property
    def needs_health_check(self) -> bool:
        """True while `is_ready` may be stale and only `check_health` can refresh it."""
        ...

    def start(self) -> None:
        """Begin serving. Returns at once; idempotent."""
        ...

    async def stop(self) -> None:
        """Stop serving and release what the client holds; requests still running fail."""
        ...

    def is_ready(self) -> bool: ...

    async def check_health(self) -> bool:
        """Probe the engine now (and learn what it serves); returns `is_ready()` afterwards."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Stream deltas; abort happens when the consumer stops iterating or calls `abort`."""
        ...

    async def abort(self, request_id: str) -> None: ...


# `EngineClient.groups` of an engine that serves one model: empty, and shared because no one may add to it.
NO_GROUPS: Mapping[str, EngineClient] = MappingProxyType({})
