"""Per-request state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ctxgate.backend.engine.api import Priority, SamplingParams
from ctxgate.backend.engine.guided import GuideMatcher
from ctxgate.backend.model.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int  # sampling.max_tokens clamped to the context window
    arrival_order: int  # global FCFS tie-breaker
    priority: Priority = Priority.USER
    cache_salt: str | None = None
    tenant: str | None = None  # whose share of the prefill this sequence spends (None: the unnamed tenant)
    weight: float = 1.0  # the tenant's weight when the request arrived
    arrival_time: float = field(default_factory=time.perf_counter)
    index: int = 0  # which of the request's n choices this sequence makes

    token_ids: list[int] = field(init=False)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the full blocks of token_ids
    num_published_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    cached_prompt_tokens: int | None = None  # prefix-cache hit at first admission
    # Stamped once by the scheduler's fair queue (ctxgate.backend.engine.fair_queue) when first queued;
    # kept through preemption, shared by the request's forked choices.
    virtual_finish: float | None = None

    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    generator: torch.Generator | None = None
    matcher: GuideMatcher | None = None  # where the output stands in its grammar (guided decoding)
    prompt_token_mask: torch.Tensor | None = None  # [vocab] bool, built once for repetition_penalty
    detokenizer: IncrementalDetokenizer | None = None
    emitted_text_len: int = 0  # chars of detokenized text already sent in deltas
    emitted_token_count: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: priority class first, then virtual finish (fair queuing between tenants;
        0 for all with fair queuing off), then arrival (FCFS)."""
        virtual_finish = 0.0 if self.virtual_finish is None else self.virtual_finish
        return (int(self.priority), virtual_finish, self.arrival_order)


@dataclass(eq=False)
class SequenceGroup:
    """One request's sequences: its first, and the n - 1 choices forked from it once its prompt is in."""

    request_id: str
    sequences: list[Sequence]
    pending_forks: int = 0  # choices not yet forked
    unfinished: int = 1  # choices (forked or not) still generating
    completion_tokens: int = 0  # of the finished choices
