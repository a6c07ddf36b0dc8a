"""Gateway settings: what `ctxgate serve` flags and tests configure."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_BODY_READ_TIMEOUT_S = 30.0
EMBED_ON = ("engine", "process")  # where the compression embedder runs (GatewaySettings.embed_on)
MAX_NICE = 19
# The compression workers' CPU priority below the engine's: by default the same, since their Python
# is on the critical path of the request they compress (docs/decisions/compression-nice.md).
DEFAULT_COMPRESSION_NICE = 0


def default_compression_workers() -> int:
    """One compression worker per two cores: a worker's Python holds the GIL that the in-process
    engine re-takes after every op, so a second worker on two cores slows the engine more than it
    speeds compression (docs/decisions/compression-workers.md)."""
    return max(1, (os.cpu_count() or 1) // 2)


@dataclass
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # HF model directory (for the in-process engine and the tokenizer); None: the default model.
    model: str | None = None
    # Name clients put in "model"; defaults to the engine's model name.
    served_model_name: str | None = None
    # Extra policy directory watched for edits; the packaged policies are always available beneath it.
    policy_dir: Path | None = None
    keys_file: Path | None = None
    # Retrieval indexes (`ctxgate index build`); None: $CTXGATE_INDEX_DIR or ~/.cache/ctxgate/indexes.
    index_dir: Path | None = None
    upstreams: list[str] = field(default_factory=list)
    upstream_model: str | None = None
    upstream_connect_timeout_s: float = 2.0
    upstream_read_timeout_s: float = 120.0
    upstream_retries: int = 1
    # Bearer key the upstream expects (vLLM's --api-key); also $CTXGATE_UPSTREAM_API_KEY.
    upstream_api_key: str | None = field(default_factory=lambda: os.environ.get("CTXGATE_UPSTREAM_API_KEY") or None)
    # What budgets are counted with when the model is remote: a local HF directory or a tiktoken
    # encoding name (e.g. cl100k_base). None: the engine's own tokenizer, or the --model directory.
    tokenizer: str | None = None
    # Drop request fields the built-in engine cannot honour instead of answering 400 (any policy).
    drop_params: bool = False
    redis_url: str | None = field(default_factory=lambda: os.environ.get("REDIS_URL") or None)
    default_policy: str = "rag-default"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    reload_interval_s: float = 1.0
    include_packaged_policies: bool = True
    # Admission control (gateway/admission.py): requests running at once, how many more may wait for
    # a slot and for how long; beyond that the answer is 503 + Retry-After. None: no limit.
    max_in_flight: int | None = 64
    max_queued: int = 64
    queue_timeout_s: float = 10.0
    # Whole-request limit once admitted (generation included); None: no limit. Over it: 504.
    request_timeout_s: float | None = 300.0
    # Bound on the in-process engine's waiting queue (beyond it the engine refuses with 503).
    engine_max_waiting_requests: int | None = 256
    # Compression's own thread budget: requests are compressed in this many worker threads, off the
    # event loop (default: default_compression_workers()); the embedding model runs in one batching
    # thread with `embed_threads` OpenMP threads, coalescing concurrent requests' sentences within
    # `embed_batch_window_ms` (on the engine's thread, calls waiting together share one pass instead).
    compression_workers: int = field(default_factory=lambda: default_compression_workers())
    # How much lower than the engine's the workers' CPU priority is (a Linux nice increment, 0-19;
    # 0: the same). See DEFAULT_COMPRESSION_NICE.
    compression_nice: int = field(default_factory=lambda: DEFAULT_COMPRESSION_NICE)
    embed_threads: int = 1
    embed_batch_window_ms: float = 3.0
    # Where the embedding model runs. "engine": with the in-process engine on a CPU, on the engine's
    # thread between its steps and layers (AsyncEngine.run_between_steps), so it is no third busy
    # thread on the engine's cores. "process" (and "engine" with an upstream or a CUDA engine): a
    # child process, because in a thread of this process its Python would hold the GIL the engine
    # thread re-takes between every op (docs/decisions/embedder-on-engine-thread.md).
    embed_on: str = "engine"
    # Embedding (and summary) cache shared by replicas and kept across restarts; None: in-process only.
    embed_cache_url: str | None = field(
        default_factory=lambda: os.environ.get("CTXGATE_EMBED_CACHE_URL") or os.environ.get("REDIS_URL") or None
    )
    # On SIGTERM: refuse new requests with 503 and wait up to this long for in-flight ones.
    drain_timeout_s: float = 30.0
    # One line per request on the `ctxgate.access` logger (no keys, no prompts); off by default.
    access_log: bool = False
    # Serving on a non-loopback address without a keys file is refused unless this says so.
    allow_unauthenticated: bool = False
    # Bearer token /metrics requires (tenant names and spend are there); None: open. Also
    # $CTXGATE_METRICS_KEY.
    metrics_key: str | None = field(default_factory=lambda: os.environ.get("CTXGATE_METRICS_KEY") or None)
    # Seconds a client may take to send its whole request body; a slower one gets 408.
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    # Server secret behind each tenant's upstream `cache_salt` (HMAC-SHA256 of the tenant name). Replicas
    # sharing an upstream should share it ($CTXGATE_CACHE_SALT_SECRET); unset: random per process.
    cache_salt_secret: str | None = field(
        default_factory=lambda: os.environ.get("CTXGATE_CACHE_SALT_SECRET") or None, repr=False)

    def __post_init__(self) -> None:
        if self.compression_workers < 1:
            raise ValueError(f"compression_workers must be at least 1, not {self.compression_workers}")
        if not 0 <= self.compression_nice <= MAX_NICE:
            raise ValueError(f"compression_nice must be from 0 to {MAX_NICE}, not {self.compression_nice}")
        if self.embed_on not in EMBED_ON:
            raise ValueError(f"embed_on must be one of {', '.join(EMBED_ON)}, not {self.embed_on!r}")
        if self.policy_dir is not None:
            self.policy_dir = Path(self.policy_dir)
        if self.keys_file is not None:
            self.keys_file = Path(self.keys_file)
        if self.body_read_timeout_s <= 0:
            raise ValueError(f"body_read_timeout_s must be positive, not {self.body_read_timeout_s}")


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
        "--keys keys.yaml`) and pass --keys keys.yaml (config file: keys_file), bind to 127.0.0.1, or, "
        "if a proxy in front authenticates, pass --allow-unauthenticated (config file: "
        "server.allow_unauthenticated: true)."
    )
