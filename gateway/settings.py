"""Gateway settings: what `ctxgate serve` flags and tests configure."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from ctxgate.backend.settings.flags import Cli
from ctxgate.gateway.cpu_share import DEFAULT_SHARE
from ctxgate.gateway.model_list_config import ModelConfig, check_model_list

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_BODY_READ_TIMEOUT_S = 30.0
MAX_NICE = 19
# The compression workers' CPU priority below the engine's: by default the same, since their Python
# is on the critical path of the request they compress (docs/decisions/compression-nice.md).
DEFAULT_COMPRESSION_NICE = 0


def default_compression_workers() -> int:
    """One compression worker per two cores: a worker's Python holds the GIL that the in-process
    engine re-takes after every op, so a second worker on two cores slows the engine more than it
    speeds compression (docs/decisions/compression-workers.md)."""
    return max(1, (os.cpu_count() or 1) // 2)


def _env(*names: str) -> Callable[[], str | None]:
    """A default read from the first of these environment variables that is set and not empty."""
    return lambda: next((os.environ[name] for name in names if os.environ.get(name)), None)


def _zero_is_none(value: Any) -> Any:
    return None if value == 0 and not isinstance(value, bool) else value  # 0: no limit


def _empty_is_none(value: Any) -> Any:
    return value or None  # an empty secret or URL (e.g. VAR= in a compose file): unset


def _at_least_one_worker(value: Any) -> Any:
    if isinstance(value, int) and value < 1:
        raise ValueError(f"compression_workers must be at least 1, not {value}")
    return value


def _nice(value: Any) -> Any:
    if isinstance(value, int) and not 0 <= value <= MAX_NICE:
        raise ValueError(f"compression_nice must be from 0 to {MAX_NICE}, not {value}")
    return value


def _positive_body_timeout(value: Any) -> Any:
    if isinstance(value, int | float) and value <= 0:
        raise ValueError(f"body_read_timeout_s must be positive, not {value}")
    return value


NoLimit = BeforeValidator(_zero_is_none)
EmptyIsNone = BeforeValidator(_empty_is_none)


class GatewaySettings(BaseModel):
    """The gateway's settings: `ctxgate serve` flags, the config file's `server:` section, and what
    code and tests pass to `create_app`."""

    model_config = ConfigDict(extra="forbid")
    # `ctxgate serve --help` sections (title -> fields); tests/gateway/test_serve_help.py checks that
    # every field is in exactly one.
    CLI_GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "server": (
            "host",
            "port",
            "served_model_name",
            "model",
            "max_body_bytes",
            "body_read_timeout_s",
            "drain_timeout_s",
            "access_log",
            "allow_unauthenticated",
            "metrics_key",
            "admin_key_file",
            "vllm_metric_names",
            "shadow_log",
            "shadow_recent",
        ),
        "tenants and policies": (
            "keys_file",
            "policy_dir",
            "include_packaged_policies",
            "default_policy",
            "reload_interval_s",
            "index_dir",
        ),
        "quotas and admission": (
            "redis_url",
            "max_in_flight",
            "max_queued",
            "max_open_per_key",
            "max_queued_per_key",
            "tenant_cpu_share",
            "queue_timeout_s",
            "request_timeout_s",
            "engine_max_waiting_requests",
        ),
        "compression": (
            "compression_workers",
            "compression_nice",
            "compression_cache_mb",
            "embed_threads",
            "embed_batch_window_ms",
            "embed_on",
            "embed_cache_url",
        ),
        "upstreams": (
            "upstreams",
            "model_list",
            "upstream_model",
            "upstream_connect_timeout_s",
            "upstream_read_timeout_s",
            "upstream_retries",
            "upstream_api_key",
            "tokenizer",
            "drop_params",
            "cache_salt_secret",
        ),
    }

    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8000, ge=1, le=65535, description="TCP port to listen on")
    # The in-process engine's (or the tokenizer's) model directory; `serve` sets it from engine.model.
    model: str | None = Field(
        default=None,
        description="GGUF file or Hugging Face model directory for the in-process engine and the "
        "tokenizer; default: the packaged model. Configured as engine.model / --model",
    )
    served_model_name: str | None = Field(
        default=None,
        description="the name clients send as 'model'; default: the engine's (or upstream's) model name",
    )
    policy_dir: Path | None = Field(
        default=None,
        description="directory of policy YAML files, watched for edits (the "
        "packaged policies stay available beneath it)",
    )
    keys_file: Annotated[Path | None, Cli(old=("--keys",))] = Field(
        default=None, description="keys file (YAML, `ctxgate keys add`); without it the gateway is open"
    )
    index_dir: Path | None = Field(
        default=None,
        description="retrieval indexes built by `ctxgate index build`; default "
        "$CTXGATE_INDEX_DIR or ~/.cache/ctxgate/indexes",
    )
    upstreams: Annotated[list[str], Cli(old=("--upstream",), metavar="URL")] = Field(
        default_factory=list,
        description="OpenAI-compatible upstream URLs used instead of the in-process engine, "
        "in fail-over order (repeat the flag for each)",
    )
    # The config file's top-level `model_list:` (no flag: a list of groups does not fit one).
    model_list: Annotated[list[ModelConfig], AfterValidator(check_model_list)] = Field(
        default_factory=list,
        description="served models, each routed over a group of deployments (config file "
        "`model_list:`; docs/routing.md); server.upstreams, when also set, is one more group",
    )
    upstream_model: Annotated[str | None, Cli(replacement="--served-model-name")] = Field(
        default=None,
        description="model name sent upstream; default: discovered from the upstream's /v1/models",
    )
    upstream_connect_timeout_s: Annotated[float, Cli(old=("--upstream-connect-timeout",))] = Field(
        default=2.0, gt=0, description="seconds to connect to an upstream before trying the next"
    )
    upstream_read_timeout_s: Annotated[float, Cli(old=("--upstream-read-timeout",))] = Field(
        default=120.0,
        gt=0,
        description="seconds an upstream may stay silent mid-response before the request fails",
    )
    upstream_retries: int = Field(
        default=1, ge=0, description="extra connection attempts per upstream URL before failing over"
    )
    upstream_api_key: Annotated[str | None, EmptyIsNone] = Field(
        default_factory=_env("CTXGATE_UPSTREAM_API_KEY"),
        repr=False,
        description="Bearer key sent to the upstreams (vLLM's --api-key); default $CTXGATE_UPSTREAM_API_KEY",
    )
    tokenizer: str | None = Field(
        default=None,
        description="count budgets with this when the model is remote: a GGUF file, a local HF "
        "tokenizer directory or a tiktoken encoding name (e.g. cl100k_base); default: "
        "the engine's tokenizer or the model directory's",
    )
    drop_params: bool = Field(
        default=False,
        description="drop request fields the built-in engine cannot honour (tools, "
        "logprobs, ...) instead of answering 400",
    )
    redis_url: Annotated[str | None, EmptyIsNone] = Field(
        default_factory=_env("REDIS_URL"),
        repr=False,
        description="Redis holding the quota ledger shared by replicas; default $REDIS_URL, unset: in-process",
    )
    default_policy: str = Field(
        default="rag-default", description="policy when neither the key nor the request names one"
    )
    max_body_bytes: int = Field(
        default=DEFAULT_MAX_BODY_BYTES,
        ge=1,
        description="larger request bodies are refused with 413 before being read",
    )
    reload_interval_s: Annotated[float, Cli(old=("--reload-interval",))] = Field(
        default=1.0, gt=0, description="seconds between checks of the policy directory and the keys file"
    )
    include_packaged_policies: bool = Field(
        default=True, description="serve the policies shipped with ctxgate beneath policy_dir's"
    )
    max_in_flight: Annotated[int | None, NoLimit] = Field(
        default=64, ge=0, description="generation requests running at once; 0: no limit"
    )
    max_queued: int = Field(
        default=64, ge=0, description="requests that may wait for a slot; beyond that: 503 + Retry-After"
    )
    max_open_per_key: Annotated[int | None, NoLimit] = Field(
        default=32,
        ge=0,
        description="generation requests one API key may have open at once (sending their body, queued or "
        "running); beyond that: 429 too_many_open_requests; 0: no limit",
    )
    max_queued_per_key: Annotated[int | None, NoLimit] = Field(
        default=16,
        ge=0,
        description="requests of one API key that may wait for a slot; beyond that: 429 "
        "too_many_queued_requests; 0: no limit",
    )
    tenant_cpu_share: Annotated[float | None, NoLimit] = Field(
        default=DEFAULT_SHARE,
        ge=0,
        le=1,
        description="share of one core the gateway may spend on one tenant's requests while another "
        "tenant has requests open; beyond it the tenant's next requests wait; 0: no limit",
    )
    queue_timeout_s: Annotated[float, Cli(old=("--queue-timeout",))] = Field(
        default=10.0, gt=0, description="seconds a request may wait for a slot before a 503"
    )
    request_timeout_s: Annotated[float | None, NoLimit, Cli(old=("--request-timeout",))] = Field(
        default=300.0,
        ge=0,
        description="seconds an admitted request may take, generation included (over it: 504); 0: no limit",
    )
    engine_max_waiting_requests: Annotated[int | None, Cli(old=("--max-waiting-requests",))] = Field(
        default=256,
        ge=1,
        description="in-process engine: refuse new requests with 503 beyond this many waiting",
    )
    compression_workers: Annotated[int, BeforeValidator(_at_least_one_worker)] = Field(
        default_factory=default_compression_workers,
        ge=1,
        description="threads that compress requests, off the event loop; default: one per two cores",
    )
    compression_nice: Annotated[int, BeforeValidator(_nice)] = Field(
        default=DEFAULT_COMPRESSION_NICE,
        ge=0,
        le=MAX_NICE,
        description="run the compression workers this many Linux nice steps below the engine's CPU priority "
        "(0: the same)",
    )
    compression_cache_mb: int = Field(
        default=512,
        ge=1,
        description="megabytes the compressor may keep per process of what it computed from client text "
        "(embedding vectors, token counts, sentence splits, word sets, summaries), shared among its LRU caches; "
        "the process's memory levels off near its baseline plus up to about twice this (allocator overhead)",
    )
    embed_threads: int = Field(
        default=1, ge=1, description="OpenMP threads of the compression embedder's batching thread"
    )
    embed_batch_window_ms: float = Field(
        default=3.0,
        ge=0,
        description="milliseconds the embedder waits to batch concurrent requests' sentences into one pass",
    )
    # In a thread of this process the embedder's Python would hold the GIL the engine thread re-takes
    # between every op; on the engine's own thread (between its steps) it is no extra busy thread.
    embed_on: Literal["engine", "process"] = Field(
        default="engine",
        description="where the compression embedder runs: engine (with the in-process CPU engine, on its "
        "thread between steps and layers) or process (a child process; also what engine means with an upstream "
        "or a CUDA engine)",
    )
    embed_cache_url: Annotated[str | None, EmptyIsNone] = Field(
        default_factory=_env("CTXGATE_EMBED_CACHE_URL", "REDIS_URL"),
        repr=False,
        description="Redis for the embedding and summary cache shared by replicas and kept across restarts; "
        "default $CTXGATE_EMBED_CACHE_URL, else $REDIS_URL; unset: in-process only",
    )
    drain_timeout_s: Annotated[float, Cli(old=("--drain-timeout",))] = Field(
        default=30.0,
        ge=0,
        description="on SIGTERM, refuse new requests with 503 and wait this long for in-flight ones",
    )
    access_log: bool = Field(
        default=True,
        description="log one line per request on the ctxgate.access logger (request "
        "id, method, path, status, tenant, policy, prompt tokens before/after, TTFT, total ms; "
        "never keys or prompts); --no-access-log turns it off",
    )
    allow_unauthenticated: bool = Field(
        default=False,
        description="serve on a non-loopback host without a keys file "
        "(only behind a proxy that authenticates)",
    )
    metrics_key: Annotated[str | None, EmptyIsNone] = Field(
        default_factory=_env("CTXGATE_METRICS_KEY"),
        repr=False,
        description="Bearer token /metrics requires (tenant names and spend are there); default "
        "$CTXGATE_METRICS_KEY, unset: /metrics is open",
    )
    admin_key_file: Path | None = Field(
        default=None,
        description="file holding the operator console's admin key (one line, 32+ characters; e.g. "
        "`openssl rand -hex 32`); it serves /console (docs/console.md). Unset: every /console route is 404",
    )
    body_read_timeout_s: Annotated[
        float, BeforeValidator(_positive_body_timeout), Cli(old=("--body-read-timeout",))
    ] = Field(
        default=DEFAULT_BODY_READ_TIMEOUT_S,
        gt=0,
        description="seconds a client may take to send its whole request body; a slower one gets 408",
    )
    cache_salt_secret: Annotated[str | None, EmptyIsNone] = Field(
        default_factory=_env("CTXGATE_CACHE_SALT_SECRET"),
        repr=False,
        description="server secret behind each tenant's upstream cache_salt (HMAC-SHA256 of the tenant name); "
        "replicas sharing an upstream should share it; default $CTXGATE_CACHE_SALT_SECRET, unset: random per "
        "process. Prefer the variable to the flag (flags show in ps)",
    )
    vllm_metric_names: bool = Field(
        default=False, description="also export the in-process engine's metrics under vLLM's names (vllm:...)"
    )
    shadow_log: Path | None = Field(
        default=None,
        description="append one JSON line per shadow comparison to this file (prompt hashes, answers, "
        "agreement), for `ctxgate eval shadow-replay`; unset: no log",
    )
    shadow_recent: int = Field(
        default=50,
        ge=0,
        le=1000,
        description="disagreements /v1/ctxgate/shadow keeps per tenant (the newest)",
    )


LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost: only this machine can connect."""
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name or "": it may resolve to (or bind) any interface


def exposure_problem(settings: GatewaySettings) -> str | None:
    """Why these settings must not be served (None: fine): an open gateway on a reachable address."""
    if settings.keys_file is not None or settings.allow_unauthenticated or is_loopback(settings.host):
        return None
    return (
        f"refusing to serve on {settings.host!r} without a keys file: anyone who can reach that address "
        "could spend every tenant's budget and read /metrics. Create keys (`ctxgate keys add TENANT "
        "--keys-file keys.yaml`) and pass --keys-file keys.yaml (config file: server.keys_file), bind to "
        "127.0.0.1, or, if a proxy in front authenticates, pass --allow-unauthenticated (config file: "
        "server.allow_unauthenticated: true)."
    )
