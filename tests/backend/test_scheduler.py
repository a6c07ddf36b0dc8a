"""Unit tests of the continuous-batching scheduler (no model: steps are simulated)."""

from __future__ import annotations

from backend.api import Priority, SamplingParams
from backend.block_manager import BlockManager
from backend.scheduler import Scheduler, SchedulerOutput
from backend.sequence import Sequence

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


def finish_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """What the engine does after the model ran: mark tokens computed, sample one token if due."""
    for item in output.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        scheduler.block_manager.cache_full_blocks(item.seq)
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.token_ids.append(7)


def make_scheduler(num_blocks=64, budget=32, max_seqs=8, ttft_ms=1e9) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK, enable_prefix_caching=False), budget, max_seqs, ttft_ms)


def test_token_budget_is_respected_and_long_prompts_are_chunked():
    scheduler = make_scheduler(budget=10)
    seq = make_seq(25, 0)
    scheduler.add(seq)
    chunks = []
    while seq.num_computed_tokens < 25:
        output = scheduler.schedule()
        assert output.num_tokens <= 10
        chunks.append(output.scheduled[0].num_new_tokens)
        finish_step(scheduler, output)
    assert chunks == [10, 10, 5]


def test_decodes_are_scheduled_before_prefills():
    scheduler = make_scheduler(budget=12)
    first, second = make_seq(8, 0), make_seq(8, 1)
    scheduler.add(first)
    finish_step(scheduler, scheduler.schedule())  # first is now decoding
    scheduler.add(second)
    output = scheduler.schedule()
    assert [(s.seq, s.num_new_tokens) for s in output.scheduled] == [(first, 1), (second, 8)]
    # A tight budget still serves the decode, and the prefill gets what is left.
    scheduler = make_scheduler(budget=4)
    a, b = make_seq(3, 0), make_seq(20, 1)
    scheduler.add(a)
    finish_step(scheduler, scheduler.schedule())
    scheduler.add(b)
    output = scheduler.schedule()
    assert [(s.seq, s.num_new_tokens) for s in output.scheduled] == [(a, 1), (b, 3)]


def test_priority_classes_then_fcfs():
    scheduler = make_scheduler(budget=4)
    background = make_seq(4, 0, Priority.BACKGROUND)
    user_late = make_seq(4, 2, Priority.USER)
    user_early = make_seq(4, 1, Priority.USER)
    for seq in (background, user_late, user_early):
        scheduler.add(seq)
    order = []  # sequences in the order their prefill starts
    for _ in range(4):
        output = scheduler.schedule()
        order.extend(item.seq for item in output.scheduled if item.seq.num_computed_tokens == 0)
        finish_step(scheduler, output)
    assert order == [user_early, user_late, background]


def test_sequence_cap():
    scheduler = make_scheduler(budget=100, max_seqs=2)
    for order in range(3):
        scheduler.add(make_seq(4, order))
    output = scheduler.schedule()
    assert len(output.scheduled) == 2 and len(scheduler.waiting) == 1


def test_preempts_the_newest_lowest_priority_sequence_when_blocks_run_out():
    scheduler = make_scheduler(num_blocks=4, budget=64)
    old, new = make_seq(8, 0), make_seq(7, 1)  # 2 blocks each: the pool is full after prefill
    scheduler.add(old)
    scheduler.add(new)
    finish_step(scheduler, scheduler.schedule())
    assert scheduler.block_manager.num_free_blocks == 0
    # old now has 9 tokens and needs a third block: new (the newest) is preempted by recompute.
    output = scheduler.schedule()
    assert output.preempted == [new]
    assert [item.seq for item in output.scheduled] == [old]
    assert new.num_computed_tokens == 0 and new.block_table == [] and new.num_preemptions == 1
    assert scheduler.waiting == [new] and scheduler.num_preemptions == 1
    # Once old finishes, new is recomputed from scratch (prompt + its generated token).
    scheduler.remove(old)
    output = scheduler.schedule()
    assert [(item.seq, item.num_new_tokens) for item in output.scheduled] == [(new, 8)]


def test_background_preempted_first_even_if_older():
    scheduler = make_scheduler(num_blocks=4, budget=64)
    background = make_seq(8, 0, Priority.BACKGROUND)
    user = make_seq(8, 1, Priority.USER)
    scheduler.add(background)
    scheduler.add(user)
    finish_step(scheduler, scheduler.schedule())
    output = scheduler.schedule()
    assert output.preempted == [background]
    assert [item.seq for item in output.scheduled] == [user]


def test_a_lone_sequence_preempts_itself_rather_than_failing():
    scheduler = make_scheduler(num_blocks=2, budget=64)
    seq = make_seq(8, 0)
    scheduler.add(seq)
    finish_step(scheduler, scheduler.schedule())
    output = scheduler.schedule()  # needs a third block that does not exist
    assert output.preempted == [seq] and output.scheduled == []


def test_ttft_pressure_makes_background_work_yield():
    scheduler = make_scheduler(budget=8, ttft_ms=0.0)  # every waiting user request is "at risk"
    background = make_seq(4, 0, Priority.BACKGROUND)
    scheduler.add(background)
    finish_step(scheduler, scheduler.schedule())
    user = make_seq(8, 1)
    scheduler.add(user)
    output = scheduler.schedule()
    assert [item.seq for item in output.scheduled] == [user]


def test_ttft_pressure_preempts_background_to_admit_a_user_request_at_the_cap():
    scheduler = make_scheduler(budget=16, max_seqs=1, ttft_ms=0.0)
    background = make_seq(4, 0, Priority.BACKGROUND)
    scheduler.add(background)
    finish_step(scheduler, scheduler.schedule())
    user = make_seq(4, 1)
    scheduler.add(user)
    output = scheduler.schedule()
    assert output.preempted == [background]
    assert [item.seq for item in output.scheduled] == [user]
