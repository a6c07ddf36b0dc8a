"""Prefills run between two decoder layers of the step in progress: a quiet tenant's short prompt
does not wait for a flooding tenant's long prefill step.

On two CPU cores a 512-token prefill step takes ~0.4 s, and a short request alone ~0.05-0.1 s. Fair
queuing puts the quiet tenant's request first in line, but the line moves only between steps: the
request waits for the rest of the step in progress, then shares the next one with the flooding
tenant's next chunk. Instead, at a decoder-layer boundary of the step in progress
(`LlamaModel.between_layers`), the engine runs a nested step for the waiting queue's head alone —
its whole uncached prompt — samples its first token and emits it, then resumes the outer step.

Which request (`Scheduler.admit_head_alone` checks the last three):
- the head of the waiting queue (priority class, then weighted fair queuing: the fair queue decides
  whose turn it is, this only decides *when*), a user request (background and shadow work never jump
  into a step);
- of a tenant with no prefill chunk in the outer step (that tenant's share is being served by the
  step itself; a tenant whose earlier request is only decoding is still eligible);
- whose uncached prompt is at most what is left of `interleaved_prefill_tokens` for this outer step
  (the same number caps the nested tokens per outer step, so the outer step's own sequences — the
  flooding tenant's goodput, everyone's decode — are delayed by that many prefill tokens at most);
- with a free sequence slot and the blocks for its whole prompt, without preempting anyone.

Invariants, and why each holds:
1. The outer step's batch is fixed. Nothing here touches a sequence it scheduled: the nested request
   comes from the waiting queue, which holds no blocks; allocation never preempts; aborts and stops
   that arrive mid-step wait for the step's end (`engine_commands.py`), adds alone are applied.
2. The nested step never reads KV the outer step has not finished writing. The outer step writes
   only into blocks held by its own sequences, at positions past their computed tokens; a block is
   published to the prefix cache only after the step that completes it (`update_from_output`), and a
   block handed out fresh loses its hash when allocated. So every prefix-cache hit is a block whose
   every layer is written, and the nested request's fresh blocks come from the free queue, held by
   no outer sequence.
3. The outer step never reads what the nested step writes: its tables hold referenced blocks only,
   the nested request's fresh blocks were free. int8 block scales are per block: disjoint too.
4. No preallocated buffer is shared: the nested step runs eagerly (`ModelRunner.execute(...,
   eager=True)`), never through the decode graphs' static buffers; index tensors, attention metadata
   and activations are built per call.
5. One level only: while a nested step runs, the hook does nothing (its own layers call it too);
   one nested step per layer boundary.
6. Bookkeeping afterwards is an ordinary step's: the nested request's computed tokens and published
   blocks are updated, its token goes through the output processor, and it becomes a running
   sequence the next `schedule()` decodes like any other.

CPU only: `AsyncEngine` installs the hook on a CPU engine. On a GPU, kernels are queued
asynchronously, so a Python callback between layers runs when a layer is *queued*, not done, and a
nested step would queue behind the outer step on the same stream anyway; its steps are tens of
milliseconds, so a quiet request waits one such step at most (there `next_request` refuses).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ctxgate.backend.engine.scheduler import ScheduledSequence, Scheduler

logger = logging.getLogger(__name__)


@dataclass
class _OuterStep:
    prefilling_tenants: frozenset[str | None]
    tokens_left: int


@dataclass
class InterleavedPrefill:
    """The budget and state of nested prefills; `tokens_per_step` 0 turns them off."""

    tokens_per_step: int
    count: int = 0  # nested steps run in all (observability, tests)
    nested_seconds: float = 0.0  # spent in nested steps during the current outer step
    _outer: _OuterStep | None = None
    _nesting: bool = False
    _error: BaseException | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return self.tokens_per_step > 0

    @property
    def in_outer_step(self) -> bool:
        """A step's forward pass is running and nested prefills may start in it."""
        return self._outer is not None

    @contextmanager
    def outer_step(self, scheduled: list[ScheduledSequence]) -> Iterator[None]:
        """While the outer step's forward pass runs with this batch, nested prefills may start."""
        self.nested_seconds = 0.0
        self._error = None
        if self.enabled:
            prefilling = (item.seq.tenant for item in scheduled if item.seq.num_uncomputed_tokens > 1)
            self._outer = _OuterStep(frozenset(prefilling), self.tokens_per_step)
        try:
            yield
        finally:
            self._outer = None

    def next_request(self, scheduler: Scheduler) -> ScheduledSequence | None:
        """The request to prefill now, admitted and allocated; None when none may (see the module)."""
        outer = self._outer
        if outer is None or self._nesting or outer.tokens_left <= 0:
            return None
        item = scheduler.admit_head_alone(outer.tokens_left, outer.prefilling_tenants)
        if item is not None:
            outer.tokens_left -= item.num_new_tokens
            self.count += 1
        return item

    @contextmanager
    def nested(self) -> Iterator[None]:
        self._nesting = True
        try:
            yield
        finally:
            self._nesting = False

    def defer(self, error: BaseException) -> None:
        """An error outside the nested request's own rows (a bug in its bookkeeping). Raised from the
        outer forward pass, it would be blamed on the outer step's requests (`isolated_step.py`
        re-runs them in halves); it is kept and raised after that pass instead, and no further nested
        step starts in this outer step."""
        logger.error("a prefill between decoder layers failed outside its request", exc_info=error)
        if self._error is None:
            self._error = error
        if self._outer is not None:
            self._outer.tokens_left = 0

    def raise_deferred(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error
