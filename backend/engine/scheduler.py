"""Continuous-batching scheduler (one token budget per step, chunked prefill, preemption).

Each step spends at most `max_num_batched_tokens` tokens on at most `max_num_seqs` sequences:
running sequences first (decodes, then unfinished prefill chunks), then waiting requests, their
prompts cut into chunks that fit the remaining budget. When the KV pool runs out, the running
sequence last in that same order is preempted: its blocks are freed and it is recomputed later (its
full blocks usually come back through the prefix cache).

Order: priority class first (every user request before any background one, whatever its tenant);
inside a class, weighted fair queuing between tenants on prefill tokens — the earliest virtual finish
goes first (`fair_queue.py`: a request starts where its tenant's previous one ended, never before the
system's virtual time, and lasts its prompt tokens / the tenant's weight), so a tenant flooding the
queue delays only itself; ties, and everything with fair queuing off, go by arrival (FCFS).

TTFT target: the scheduler keeps an estimate of prefill speed. When the first waiting user request
would miss `ttft_target_ms` at that speed, background-priority work yields: background sequences
are not scheduled that step (their budget goes to the prefill), and if the sequence cap is what
blocks admission, the newest background sequence is preempted to make room.

Shadow work (`Priority.SHADOW`) only takes what real requests leave: it is admitted only when no
other request waits, and when a waiting request needs room (the sequence cap, the KV pool, or its
TTFT at risk) every running shadow sequence is dropped at the start of the step, never recomputed
(`SchedulerOutput.dropped`; the engine ends those requests with an error).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from ctxgate.backend.engine.api import Priority
from ctxgate.backend.engine.block_manager import BlockManager, require_invariant
from ctxgate.backend.engine.fair_queue import FairQueue
from ctxgate.backend.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Shadow sequences taken out for real work: their blocks are freed and they are not queued again.
    dropped: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        ttft_target_ms: float = 1500.0,
        fair_queuing: bool = True,
    ):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.ttft_target_s = ttft_target_ms / 1000.0
        self.fair = FairQueue(enabled=fair_queuing)
        self.waiting: list[Sequence] = []  # kept sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        # Prefill speed estimate (tokens/s), updated from measured steps.
        self.prefill_tokens_per_s = 2000.0

    def num_prefill_tokens_left(self) -> int:
        """Prompt tokens not yet computed: every waiting sequence's, and running sequences' chunks
        still to prefill (a decoding sequence's one pending token is not prefill). Shadow work is left
        out: a new request never queues behind it."""
        left = sum(seq.num_uncomputed_tokens for seq in self.waiting if seq.priority is not Priority.SHADOW)
        for seq in self.running:
            if seq.priority is not Priority.SHADOW:
                left += max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
        return left

    # ---- queue management ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.fair.stamp(seq)
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def has_room(self, num_seqs: int) -> bool:
        return len(self.running) + num_seqs <= self.max_num_seqs

    def add_running(self, seq: Sequence) -> None:
        """Run a sequence that already holds blocks (a choice forked from its request's first,
        `BlockManager.fork`): it computes its prompt's tail next step, with no admission."""
        assert seq.block_table and self.has_room(1)
        self.fair.stamp(seq)
        seq.status = SequenceStatus.RUNNING
        seq.first_scheduled_time = seq.first_scheduled_time or time.perf_counter()
        seq.cached_prompt_tokens = seq.num_computed_tokens
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take seq out of the queues and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def check_invariants(self) -> None:
        """Raise InvariantError if the queues, or the queues and the block pool, disagree.

        Running sequences are the only block holders: a waiting one (new or preempted) holds none.
        """
        for seq in self.waiting:
            require_invariant(
                seq.status is SequenceStatus.WAITING, f"waiting {seq.request_id} is {seq.status}"
            )
            require_invariant(not seq.block_table, f"waiting {seq.request_id} holds blocks {seq.block_table}")
        for seq in self.running:
            require_invariant(
                seq.status is SequenceStatus.RUNNING, f"running {seq.request_id} is {seq.status}"
            )
        for seq in self.waiting + self.running:
            require_invariant(seq.virtual_finish is not None, f"{seq.request_id} has no virtual finish")
        waiting_ids = {id(seq) for seq in self.waiting}
        require_invariant(
            not any(id(seq) in waiting_ids for seq in self.running), "a sequence is both waiting and running"
        )
        keys = [seq.sort_key for seq in self.waiting]
        require_invariant(
            keys == sorted(keys), "the waiting queue is out of priority / virtual finish / arrival order"
        )
        require_invariant(
            len(self.running) <= self.max_num_seqs,
            f"{len(self.running)} sequences run, more than max_num_seqs={self.max_num_seqs}",
        )
        self.block_manager.check_invariants(holders=self.running)

    def update_from_output(self, output: SchedulerOutput, step_seconds: float) -> None:
        """After the model ran `output`: its tokens are computed, full blocks join the prefix cache,
        and the step's prefill speed feeds the TTFT estimate.

        The caller appends sampled tokens afterwards; a sequence whose prompt is not yet fully
        computed (a prefill chunk) samples none.
        """
        num_prefill_tokens = 0
        for item in output.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(item.seq)
            if item.num_new_tokens > 1:
                num_prefill_tokens += item.num_new_tokens
        self._observe_prefill(num_prefill_tokens, step_seconds)

    def _observe_prefill(self, num_prefill_tokens: int, seconds: float) -> None:
        # Steps with a few prefill tokens are dominated by decode cost and would skew the estimate.
        if num_prefill_tokens >= 32 and seconds > 0:
            rate = num_prefill_tokens / seconds
            self.prefill_tokens_per_s = 0.7 * self.prefill_tokens_per_s + 0.3 * rate

    # ---- scheduling -------------------------------------------------------------------------
    def _preempt(self, seq: Sequence, output: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        if seq.priority is Priority.SHADOW:  # dropped, not recomputed: the engine ends its request
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
            output.dropped.append(seq)
            return
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        output.preempted.append(seq)
        self.add(seq)

    def _real_work_needs_room(self, ttft_pressure: bool) -> bool:
        """A waiting non-shadow request could not start beside the running shadow work: the sequence
        cap is reached, the free blocks cannot hold its next chunk, or its TTFT is at risk."""
        head = next((s for s in self.waiting if s.priority is not Priority.SHADOW), None)
        if head is None:
            return False
        if ttft_pressure or not self.has_room(1):
            return True
        chunk = min(head.num_uncomputed_tokens, self.max_num_batched_tokens)
        return self.block_manager.num_free_blocks * self.block_manager.block_size < chunk

    def _drop_shadow_work(self, output: SchedulerOutput) -> None:
        for seq in [s for s in self.running if s.priority is Priority.SHADOW]:
            self._preempt(seq, output)

    def _pick_victim(self, scheduled_ids: set[int]) -> Sequence | None:
        candidates = [s for s in self.running if id(s) not in scheduled_ids]
        return max(candidates, key=lambda s: s.sort_key) if candidates else None

    def _user_request_at_risk(self, now: float) -> bool:
        for seq in self.waiting:
            if seq.priority is not Priority.USER:
                return False
            projected = now - seq.arrival_time + seq.num_uncomputed_tokens / self.prefill_tokens_per_s
            return projected > self.ttft_target_s
        return False

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        now = time.perf_counter()
        ttft_pressure = self._user_request_at_risk(now)
        if self._real_work_needs_room(ttft_pressure):
            self._drop_shadow_work(output)

        self.running.sort(key=lambda s: s.sort_key)
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefilling:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            if ttft_pressure and seq.priority is Priority.BACKGROUND:
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                # Shadow work never takes blocks from another sequence: it gives its own up.
                victim = (
                    None if seq.priority is Priority.SHADOW else self._pick_victim(scheduled_ids | {id(seq)})
                )
                if victim is None:
                    victim = seq
                self._preempt(victim, output)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            output.scheduled.append(ScheduledSequence(seq, num_new))
            scheduled_ids.add(id(seq))
            budget -= num_new

        if output.preempted:
            return output  # the pool is tight: do not admit more work this step

        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.priority is Priority.SHADOW and any(
                s.priority is not Priority.SHADOW for s in self.waiting
            ):
                break  # idle capacity only (an order other than priority-first may put it ahead)
            if len(self.running) >= self.max_num_seqs:
                if not (
                    ttft_pressure and seq.priority is Priority.USER and self._make_room(output, scheduled_ids)
                ):
                    break
            cached_blocks = self.block_manager.find_cached_prefix(seq)
            num_cached = len(cached_blocks) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(seq, num_new, cached_blocks):
                break
            self._start_head(num_cached, now)
            output.scheduled.append(ScheduledSequence(seq, num_new))
            scheduled_ids.add(id(seq))
            budget -= num_new
        if not self.waiting:
            self.fair.drained()
        return output

    def _start_head(self, num_cached: int, now: float) -> Sequence:
        """The waiting queue's head, its slots allocated (`num_cached` of them prefix-cache hits),
        joins the running batch."""
        seq = self.waiting.pop(0)
        self.fair.admitted(seq)
        if seq.cached_prompt_tokens is None:  # first admission: what the prefix cache saved it
            seq.cached_prompt_tokens = num_cached
            self.prefix_cache_queried_tokens += seq.num_tokens
            self.prefix_cache_hit_tokens += num_cached
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return seq

    def admit_head_alone(
        self, max_tokens: int, busy_tenants: Collection[str | None]
    ) -> ScheduledSequence | None:
        """Start the waiting queue's head with its whole uncached prompt, outside `schedule()`: for a
        prefill between the decoder layers of a step in progress (`interleaved_prefill.py`).

        Only a user request of a tenant not in `busy_tenants`, whose uncached tokens are at most
        `max_tokens`, with a free sequence slot and free blocks: no one is preempted, and nothing the
        step in progress scheduled is touched. Its prefix-cache hits are blocks published by earlier
        steps, every layer written (a block is published after the step that completes it).
        """
        if not self.waiting or not self.has_room(1):
            return None
        seq = self.waiting[0]
        if seq.priority is not Priority.USER or seq.tenant in busy_tenants:
            return None
        size = self.block_manager.block_size
        if seq.num_tokens - (seq.num_tokens - 1) // size * size > max_tokens:
            return None  # even the longest prefix hit would leave too much (checked before hashing)
        cached_blocks = self.block_manager.find_cached_prefix(seq)
        num_cached = len(cached_blocks) * size
        num_new = seq.num_tokens - num_cached
        if num_new > max_tokens or not self.block_manager.allocate_slots(seq, num_new, cached_blocks):
            return None
        self._start_head(num_cached, time.perf_counter())
        return ScheduledSequence(seq, num_new)

    def _make_room(self, output: SchedulerOutput, scheduled_ids: set[int]) -> bool:
        """Preempt the unscheduled background sequence last in order so a user request can start."""
        background = [
            s for s in self.running if s.priority is Priority.BACKGROUND and id(s) not in scheduled_ids
        ]
        if not background:
            return False
        victim = max(background, key=lambda s: s.sort_key)
        self._preempt(victim, output)
        return True
