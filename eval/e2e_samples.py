"""What `ctxgate bench e2e` measures: its arms and passes, its options, one request's sample."""

from __future__ import annotations

from dataclasses import dataclass, field

ARMS = ("full", "compressed", "ideal", "engine")
PASSES = ("cold", "warm")
# Orders the arms run in, rotated per chunk. The compressed arm always runs before ideal and engine:
# their messages are fetched after it, so the fetch never warms the gateway for the compressed arm.
ARM_ORDERS: tuple[tuple[str, ...], ...] = (
    ("full", "compressed", "ideal", "engine"),
    ("compressed", "engine", "ideal", "full"),
    ("compressed", "full", "ideal", "engine"),
    ("compressed", "ideal", "engine", "full"),
)
TAG_PLACEHOLDER = "bench-tag-000000000000"
OPEN_LOOP = 0  # the level (Sample.concurrency) of an open-loop run
OPEN_LOOP_CHUNK_CLIENTS = 4
# Open loop, requests/s is the rate the arm was offered, not what it can serve: these checks need
# the closed loop and are left undecided.
CLOSED_LOOP_ONLY_CHECKS = ("gateway_vs_engine_req_s", "efficiency", "gain")


@dataclass
class E2EOptions:
    dataset: str
    limit: int | None = None
    concurrencies: list[int] = field(default_factory=lambda: [4])
    output_tokens: int = 32
    policy: str = "rag-default"
    full_policy: str = "passthrough"
    warm_pass: bool = True
    rounds_per_chunk: int = 2
    model: str | None = None
    policy_dir: str | None = None
    progress: bool = True
    engine_server: bool = False
    embed_on: str = "engine"  # the gateway's `serve --embed-on`
    compression_workers: int | None = None  # the gateway's `serve --compression-workers`; None: its default
    compression_nice: int | None = None  # the gateway's `serve --compression-nice`; None: its default
    max_num_batched_tokens: int | None = None  # the engine's token budget per step (gateway and engine alone)
    # Open loop: requests arrive at this Poisson rate (requests/s), whether or not earlier ones have
    # finished, instead of `concurrency` clients that each wait for their last reply. One level.
    arrival_rate: float | None = None

    @property
    def levels(self) -> list[int]:
        """The concurrency levels; open loop runs one level, labelled 0 (no client count)."""
        return [OPEN_LOOP] if self.arrival_rate else self.concurrencies

    def chunk_size(self, concurrency: int) -> int:
        """Requests per interleaved chunk: open loop, as many as four closed-loop clients' chunk."""
        return max(1, (concurrency or OPEN_LOOP_CHUNK_CLIENTS) * self.rounds_per_chunk)


@dataclass
class Sample:
    """One request as the client saw it, plus what the server reported in usage."""

    arm: str
    pass_name: str
    concurrency: int
    question_id: str
    ttft_ms: float
    e2e_ms: float
    output_tokens: int
    prompt_tokens: int
    original_prompt_tokens: int | None = None
    cached_prompt_tokens: int = 0
    prefill_ms: float | None = None
    compression_ms: float | None = None
    compression_stage_ms: dict[str, float] = field(default_factory=dict)
    compression_wait_ms: float | None = None  # waiting for a compression worker (not in compression_ms)
    queue_ms: float | None = None  # the engine's queue time (incl. the wait for the step in progress)
    # Time the compression's embedding passes held the engine's thread (every running request waited).
    compression_engine_ms: float | None = None
    error: str | None = None
    # The request's place in its chunk's send order (0-based). Closed loop: the first `concurrency`
    # are sent together, each later one when an earlier request of the chunk finishes.
    position: int | None = None

    @property
    def tpot_ms(self) -> float | None:
        if self.output_tokens <= 1 or self.error:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)


@dataclass
class ArmRun:
    """One arm over one chunk: its samples, wall time and the neighbours' CPU meanwhile."""

    arm: str
    samples: list[Sample]
    wall_s: float
    others_cpu_frac: float
