"""Unit tests of the continuous-batching scheduler (no model: steps are simulated).

Every test schedules through `schedule()` and `finish_step()` below, which check the scheduler's
and the block pool's invariants after each call; a random-operation property test ends the file."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ctxgate.backend.engine.api import Priority, SamplingParams
from ctxgate.backend.engine.block_manager import BlockManager
from ctxgate.backend.engine.scheduler import Scheduler, SchedulerOutput
from ctxgate.backend.engine.sequence import Sequence

BLOCK = 4


def make_seq(num_tokens: int, order: int, priority: Priority = Priority.USER) -> Sequence:
    return Sequence(
        request_id=f"r{order}",
        prompt_token_ids=[order + 1] * num_tokens,
        sampling=SamplingParams(max_tokens=100),
        max_tokens=100,
        arrival_order=order,
        priority=priority,
    )


def schedule(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.check_invariants()
    return output


def finish_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """What the engine does after the model ran: mark tokens computed, sample one token if due."""
    scheduler.update_from_output(output, step_seconds=0.01)
    for item in output.scheduled:
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.token_ids.append(7)
    scheduler.check_invariants()


def remove(scheduler: Scheduler, seq: Sequence) -> None:
    scheduler.remove(seq)
    scheduler.check_invariants()


def make_scheduler(num_blocks=64, budget=32, max_seqs=8, ttft_ms=1e9, fair=True) -> Scheduler:
    manager = BlockManager(num_blocks, BLOCK, enable_prefix_caching=False)
    return Scheduler(manager, budget, max_seqs, ttft_ms, fair_queuing=fair)


def test_token_budget_is_respected_and_long_prompts_are_chunked():
    scheduler = make_scheduler(budget=10)
    seq = make_seq(25, 0)
    scheduler.add(seq)
    chunks = []
    while seq.num_computed_tokens < 25:
        output = schedule(scheduler)
        assert output.num_tokens <= 10
        chunks.append(output.scheduled[0].num_new_tokens)
        finish_step(scheduler, output)
    assert chunks == [10, 10, 5]


def test_decodes_are_scheduled_before_prefills():
    scheduler = make_scheduler(budget=12)
    first, second = make_seq(8, 0), make_seq(8, 1)
    scheduler.add(first)
    finish_step(scheduler, schedule(scheduler))  # first is now decoding
    scheduler.add(second)
    output = schedule(scheduler)
    assert [(s.seq, s.num_new_tokens) for s in output.scheduled] == [(first, 1), (second, 8)]
    # A tight budget still serves the decode, and the prefill gets what is left.
    scheduler = make_scheduler(budget=4)
    a, b = make_seq(3, 0), make_seq(20, 1)
    scheduler.add(a)
    finish_step(scheduler, schedule(scheduler))
    scheduler.add(b)
    output = schedule(scheduler)
    assert [(s.seq, s.num_new_tokens) for s in output.scheduled] == [(a, 1), (b, 3)]


def test_priority_classes_then_fcfs():
    # Added out of arrival order, which only FCFS can see: with fair queuing a tenant's requests go in
    # the order they were added (the engine adds them as they arrive), see tests/backend/test_fair_queue.py.
    scheduler = make_scheduler(budget=4, fair=False)
    background = make_seq(4, 0, Priority.BACKGROUND)
    user_late = make_seq(4, 2, Priority.USER)
    user_early = make_seq(4, 1, Priority.USER)
    for seq in (background, user_late, user_early):
        scheduler.add(seq)
    order = []  # sequences in the order their prefill starts
    for _ in range(4):
        output = schedule(scheduler)
        order.extend(item.seq for item in output.scheduled if item.seq.num_computed_tokens == 0)
        finish_step(scheduler, output)
    assert order == [user_early, user_late, background]


def test_sequence_cap():
    scheduler = make_scheduler(budget=100, max_seqs=2)
    for order in range(3):
        scheduler.add(make_seq(4, order))
    output = schedule(scheduler)
    assert len(output.scheduled) == 2 and len(scheduler.waiting) == 1


def test_preempts_the_newest_lowest_priority_sequence_when_blocks_run_out():
    scheduler = make_scheduler(num_blocks=4, budget=64)
    old, new = make_seq(8, 0), make_seq(7, 1)  # 2 blocks each: the pool is full after prefill
    scheduler.add(old)
    scheduler.add(new)
    finish_step(scheduler, schedule(scheduler))
    assert scheduler.block_manager.num_free_blocks == 0
    # old now has 9 tokens and needs a third block: new (the newest) is preempted by recompute.
    output = schedule(scheduler)
    assert output.preempted == [new]
    assert [item.seq for item in output.scheduled] == [old]
    assert new.num_computed_tokens == 0 and new.block_table == [] and new.num_preemptions == 1
    assert scheduler.waiting == [new] and scheduler.num_preemptions == 1
    # Once old finishes, new is recomputed from scratch (prompt + its generated token).
    remove(scheduler, old)
    output = schedule(scheduler)
    assert [(item.seq, item.num_new_tokens) for item in output.scheduled] == [(new, 8)]


def test_background_preempted_first_even_if_older():
    scheduler = make_scheduler(num_blocks=4, budget=64)
    background = make_seq(8, 0, Priority.BACKGROUND)
    user = make_seq(8, 1, Priority.USER)
    scheduler.add(background)
    scheduler.add(user)
    finish_step(scheduler, schedule(scheduler))
    output = schedule(scheduler)
    assert output.preempted == [background]
    assert [item.seq for item in output.scheduled] == [user]


def test_a_lone_sequence_preempts_itself_rather_than_failing():
    scheduler = make_scheduler(num_blocks=2, budget=64)
    seq = make_seq(8, 0)
    scheduler.add(seq)
    finish_step(scheduler, schedule(scheduler))
    output = schedule(scheduler)  # needs a third block that does not exist
    assert output.preempted == [seq] and output.scheduled == []


def test_ttft_pressure_makes_background_work_yield():
    scheduler = make_scheduler(budget=8, ttft_ms=0.0)  # every waiting user request is "at risk"
    background = make_seq(4, 0, Priority.BACKGROUND)
    scheduler.add(background)
    finish_step(scheduler, schedule(scheduler))
    user = make_seq(8, 1)
    scheduler.add(user)
    output = schedule(scheduler)
    assert [item.seq for item in output.scheduled] == [user]


def test_ttft_pressure_preempts_background_to_admit_a_user_request_at_the_cap():
    scheduler = make_scheduler(budget=16, max_seqs=1, ttft_ms=0.0)
    background = make_seq(4, 0, Priority.BACKGROUND)
    scheduler.add(background)
    finish_step(scheduler, schedule(scheduler))
    user = make_seq(4, 1)
    scheduler.add(user)
    output = schedule(scheduler)
    assert output.preempted == [background]
    assert [item.seq for item in output.scheduled] == [user]


# Prompts are prefixes of these, so admissions hit the prefix cache and share blocks.
SHARED_PROMPTS = [[1] * 14, [2, 3] * 7]
MAX_OUTPUT_TOKENS = 6


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals (every priority class, several tenants and weights), steps and aborts against a
    pool small enough that sequences get preempted and cached blocks evicted; the invariants (the
    waiting queue in priority / virtual finish / arrival order included) must hold after each."""

    @initialize(ttft_pressure=st.booleans(), fair_queuing=st.booleans())
    def build_scheduler(self, ttft_pressure: bool, fair_queuing: bool) -> None:
        # 6 blocks of 4 tokens: one sequence (at most 14 + 6 tokens) always fits on its own.
        manager = BlockManager(num_blocks=6, block_size=BLOCK, enable_prefix_caching=True)
        self.scheduler = Scheduler(
            manager,
            max_num_batched_tokens=12,
            max_num_seqs=3,
            ttft_target_ms=0.0 if ttft_pressure else 1e9,
            fair_queuing=fair_queuing,
        )
        self.arrivals = itertools.count()

    @rule(
        base=st.sampled_from(SHARED_PROMPTS),
        length=st.integers(1, 14),
        priority=st.sampled_from(list(Priority)),
        tenant=st.sampled_from([None, "a", "b"]),
        weight=st.sampled_from([0.5, 1.0, 3.0]),
    )
    def arrive(
        self, base: list[int], length: int, priority: Priority, tenant: str | None, weight: float
    ) -> None:
        order = next(self.arrivals)
        seq = Sequence(
            request_id=f"r{order}",
            prompt_token_ids=base[:length],
            sampling=SamplingParams(max_tokens=MAX_OUTPUT_TOKENS),
            max_tokens=MAX_OUTPUT_TOKENS,
            arrival_order=order,
            priority=priority,
            tenant=tenant,
            weight=weight,
        )
        self.scheduler.add(seq)

    @rule(token=st.integers(1, 3))
    def step(self, token: int) -> None:
        was_waiting = {id(seq) for seq in self.scheduler.waiting}
        output = self.scheduler.schedule()
        scheduled = [item.seq for item in output.scheduled]
        assert output.num_tokens <= self.scheduler.max_num_batched_tokens
        assert all(item.num_new_tokens >= 1 for item in output.scheduled)
        assert len(set(map(id, scheduled))) == len(scheduled) <= self.scheduler.max_num_seqs
        assert not {id(seq) for seq in output.preempted} & set(map(id, scheduled))
        # Shadow work: dropped, never queued again; admitted only when no other request is left waiting.
        assert all(seq.priority is Priority.SHADOW for seq in output.dropped)
        queued = {id(seq) for seq in self.scheduler.waiting + self.scheduler.running}
        assert not {id(seq) for seq in output.dropped} & (queued | set(map(id, scheduled)))
        if any(seq.priority is not Priority.SHADOW for seq in self.scheduler.waiting):
            admitted = [seq for seq in scheduled if id(seq) in was_waiting]
            assert all(seq.priority is not Priority.SHADOW for seq in admitted)
        self.scheduler.check_invariants()
        self.scheduler.update_from_output(output, step_seconds=0.01)
        for item in output.scheduled:
            seq = item.seq
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(token)
                if seq.num_output_tokens >= seq.max_tokens:
                    self.scheduler.remove(seq)

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.scheduler.remove(data.draw(st.sampled_from(self.scheduler.waiting + self.scheduler.running)))

    @invariant()
    def consistent(self) -> None:
        self.scheduler.check_invariants()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)


def test_prefill_tokens_left_counts_waiting_prompts_and_unfinished_chunks_only():
    scheduler = make_scheduler(budget=10)
    first, second = make_seq(25, 0), make_seq(7, 1)
    scheduler.add(first)
    scheduler.add(second)
    assert scheduler.num_prefill_tokens_left() == 32
    finish_step(scheduler, schedule(scheduler))  # 10 of the first prompt
    assert scheduler.num_prefill_tokens_left() == 22
    while first.num_computed_tokens < 25 or second.num_computed_tokens < 7:
        finish_step(scheduler, schedule(scheduler))
    assert scheduler.num_prefill_tokens_left() == 0  # decoding: their pending sampled tokens are not prefill


def test_shadow_work_is_admitted_only_when_nothing_else_waits():
    scheduler = make_scheduler(budget=64)
    shadow, user = make_seq(8, 0, Priority.SHADOW), make_seq(8, 1)
    scheduler.add(shadow)
    scheduler.add(user)
    output = schedule(scheduler)
    assert [item.seq for item in output.scheduled] == [user, shadow]  # room for both: behind the user's
    busy = make_scheduler(budget=8)
    shadow, user = make_seq(4, 0, Priority.SHADOW), make_seq(8, 1)
    busy.add(shadow)
    busy.add(user)
    assert [item.seq for item in schedule(busy).scheduled] == [user]  # the user's prompt takes the budget
    assert busy.waiting == [shadow]


def test_shadow_work_is_dropped_not_requeued_when_a_request_needs_the_sequence_slot():
    scheduler = make_scheduler(budget=16, max_seqs=1)
    shadow = make_seq(4, 0, Priority.SHADOW)
    scheduler.add(shadow)
    finish_step(scheduler, schedule(scheduler))
    user = make_seq(4, 1)
    scheduler.add(user)
    output = schedule(scheduler)
    assert output.dropped == [shadow] and output.preempted == []
    assert [item.seq for item in output.scheduled] == [user]
    assert shadow not in scheduler.waiting and not shadow.block_table


def test_shadow_work_is_dropped_when_the_pool_cannot_hold_a_waiting_prompt():
    scheduler = make_scheduler(num_blocks=4, budget=64)
    shadow = make_seq(12, 0, Priority.SHADOW)  # 3 of the 4 blocks
    scheduler.add(shadow)
    finish_step(scheduler, schedule(scheduler))
    user = make_seq(8, 1)  # needs 2
    scheduler.add(user)
    output = schedule(scheduler)
    assert output.dropped == [shadow]
    assert [item.seq for item in output.scheduled] == [user]


def test_shadow_work_keeps_running_beside_requests_that_fit():
    scheduler = make_scheduler(num_blocks=64, budget=64)
    shadow = make_seq(4, 0, Priority.SHADOW)
    scheduler.add(shadow)
    finish_step(scheduler, schedule(scheduler))
    user = make_seq(4, 1)
    scheduler.add(user)
    output = schedule(scheduler)
    assert output.dropped == []
    assert {id(item.seq) for item in output.scheduled} == {id(shadow), id(user)}


def test_waiting_shadow_prompts_are_not_prefill_a_request_queues_behind():
    scheduler = make_scheduler(budget=8)
    scheduler.add(make_seq(20, 0, Priority.SHADOW))
    scheduler.add(make_seq(5, 1))
    assert scheduler.num_prefill_tokens_left() == 5


def test_shadow_work_that_runs_out_of_blocks_drops_itself_not_another_sequence():
    scheduler = make_scheduler(num_blocks=3, budget=64)
    user, shadow = make_seq(7, 0), make_seq(4, 1, Priority.SHADOW)
    scheduler.add(user)
    scheduler.add(shadow)
    finish_step(scheduler, schedule(scheduler))  # 2 + 1 blocks: the pool is full
    output = schedule(scheduler)  # the shadow's next token needs a fourth block
    assert output.dropped == [shadow] and output.preempted == []
    assert [item.seq for item in output.scheduled] == [user]
