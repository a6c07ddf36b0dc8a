"""Which waiting request may be prefilled between the decoder layers of a step in progress, and what
that does to the scheduler and the block pool (no model: the step is simulated, invariants checked).
The real engine's nested steps: test_interleaved_prefill_engine.py."""

from __future__ import annotations

import itertools

import pytest

from ctxgate.backend.engine.api import Priority, SamplingParams
from ctxgate.backend.engine.block_manager import BlockManager
from ctxgate.backend.engine.interleaved_prefill import InterleavedPrefill
from ctxgate.backend.engine.scheduler import Scheduler, SchedulerOutput
from ctxgate.backend.engine.sequence import Sequence, SequenceStatus
from tests.backend.test_scheduler import BLOCK, finish_step, schedule

_orders = itertools.count()


def seq_of(tenant: str, tokens: list[int], priority: Priority = Priority.USER) -> Sequence:
    order = next(_orders)
    return Sequence(
        request_id=f"{tenant}-{order}",
        prompt_token_ids=tokens,
        sampling=SamplingParams(max_tokens=4),
        max_tokens=4,
        arrival_order=order,
        priority=priority,
        tenant=tenant,
    )


def make(
    budget: int = 32, max_seqs: int = 8, num_blocks: int = 64, caching: bool = False
) -> tuple[Scheduler, InterleavedPrefill]:
    manager = BlockManager(num_blocks, BLOCK, enable_prefix_caching=caching)
    return Scheduler(manager, budget, max_seqs, ttft_target_ms=1e9), InterleavedPrefill(tokens_per_step=16)


def flood_step(scheduler: Scheduler, prompt_tokens: int = 64) -> tuple[Sequence, SchedulerOutput]:
    """Tenant a's long prompt takes the whole step budget."""
    flood = seq_of("a", list(range(1, prompt_tokens + 1)))
    scheduler.add(flood)
    return flood, schedule(scheduler)


def fixed(output: SchedulerOutput) -> list[tuple[Sequence, int, int, list[int]]]:
    """What the step in progress scheduled, as the forward pass sees it."""
    return [
        (item.seq, item.num_new_tokens, item.seq.num_computed_tokens, list(item.seq.block_table))
        for item in output.scheduled
    ]


def test_a_quiet_tenants_short_request_starts_alone_and_leaves_the_step_as_it_was():
    scheduler, interleaved = make()
    _, output = flood_step(scheduler)
    before = fixed(output)
    quiet = seq_of("b", [7] * 10)
    with interleaved.outer_step(output.scheduled):
        scheduler.add(quiet)  # sent while the step runs
        item = interleaved.next_request(scheduler)
        assert item is not None and (item.seq, item.num_new_tokens) == (quiet, 10)
        assert quiet.status is SequenceStatus.RUNNING and quiet in scheduler.running
        assert fixed(output) == before  # the outer step's batch and tables are untouched
        assert not set(quiet.block_table) & {b for *_, table in before for b in table}
        scheduler.check_invariants()
        finish_step(scheduler, SchedulerOutput([item]))  # the nested step ran: its first token
    finish_step(scheduler, output)
    assert quiet.num_output_tokens == 1 and interleaved.count == 1
    following = schedule(scheduler)
    assert (quiet, 1) in [(i.seq, i.num_new_tokens) for i in following.scheduled]  # decodes as usual


@pytest.mark.parametrize(
    "why",
    ["same tenant as the step's prefill", "too long", "background", "shadow", "no slot", "no blocks", "off"],
)
def test_a_request_that_may_not_jump_in_waits_for_the_step(why: str):
    scheduler, interleaved = make(
        max_seqs=1 if why == "no slot" else 8, num_blocks=10 if why == "no blocks" else 64
    )
    if why == "off":
        interleaved = InterleavedPrefill(tokens_per_step=0)
    flood, output = flood_step(scheduler)
    tenant = "a" if why == "same tenant as the step's prefill" else "b"
    priority = {"background": Priority.BACKGROUND, "shadow": Priority.SHADOW}.get(why, Priority.USER)
    waiting = seq_of(tenant, [7] * (17 if why == "too long" else 10), priority)
    with interleaved.outer_step(output.scheduled):
        scheduler.add(waiting)
        assert interleaved.next_request(scheduler) is None
        assert scheduler.waiting[0] is waiting and not waiting.block_table
        assert flood.status is SequenceStatus.RUNNING  # nobody was preempted to make room
        scheduler.check_invariants()
    assert interleaved.count == 0


def test_a_tenant_whose_earlier_request_only_decodes_may_jump_in():
    scheduler, interleaved = make(budget=40)
    earlier = seq_of("b", [5] * 8)
    scheduler.add(earlier)
    finish_step(scheduler, schedule(scheduler))  # b's first request decodes from now on
    _, output = flood_step(scheduler)
    assert (earlier, 1) in [(i.seq, i.num_new_tokens) for i in output.scheduled]
    with interleaved.outer_step(output.scheduled):
        scheduler.add(later := seq_of("b", [6] * 10))
        item = interleaved.next_request(scheduler)
    assert item is not None and item.seq is later


def test_nested_prefills_share_one_token_cap_per_outer_step():
    scheduler, interleaved = make()
    _, output = flood_step(scheduler)
    first, second = seq_of("b", [7] * 10), seq_of("c", [8] * 10)
    with interleaved.outer_step(output.scheduled):
        scheduler.add(first)
        scheduler.add(second)
        item = interleaved.next_request(scheduler)
        assert item is not None and item.seq is first
        finish_step(scheduler, SchedulerOutput([item]))
        assert interleaved.next_request(scheduler) is None  # 10 of 16 spent: 10 more would pass it
        assert scheduler.waiting == [second]
    finish_step(scheduler, output)
    output = schedule(scheduler)
    assert scheduler.waiting == [second]  # a's running prefill took the step's whole budget again
    with interleaved.outer_step(output.scheduled):  # the next outer step's cap is fresh
        item = interleaved.next_request(scheduler)
    assert item is not None and item.seq is second and interleaved.count == 2


def test_nothing_starts_outside_a_step_or_inside_a_nested_one():
    scheduler, interleaved = make()
    _, output = flood_step(scheduler)
    scheduler.add(seq_of("b", [7] * 10))
    assert interleaved.next_request(scheduler) is None  # no step in progress
    with interleaved.outer_step(output.scheduled), interleaved.nested():
        assert interleaved.next_request(scheduler) is None  # one level only
    assert interleaved.count == 0


def test_prefix_hits_are_only_blocks_published_before_the_step():
    """The outer step writes tenant a's first blocks; a request sharing that prefix gets no hit on
    them during that step (their later layers are not written yet), and a hit once they are."""
    scheduler, interleaved = make(budget=16, caching=True)
    prompt = list(range(1, 33))
    flood, output = flood_step(scheduler, prompt_tokens=32)
    # Same tenant salt (none): only the publication rule keeps the hit out.
    during = seq_of("b", prompt[:8] + [99, 98])
    with interleaved.outer_step(output.scheduled):
        scheduler.add(during)
        item = interleaved.next_request(scheduler)
        assert item is not None and item.num_new_tokens == 10 and during.cached_prompt_tokens == 0
        finish_step(scheduler, SchedulerOutput([item]))
    finish_step(scheduler, output)  # flood's first 16 tokens (4 blocks) are published now
    output = schedule(scheduler)
    after = seq_of("c", prompt[:8] + [97, 96])
    with interleaved.outer_step(output.scheduled):
        scheduler.add(after)
        item = interleaved.next_request(scheduler)
        assert item is not None and item.num_new_tokens == 2 and after.cached_prompt_tokens == 8
        # The nested request published that prefix first (its step ended first): a's copies stay private.
        assert after.block_table[:2] == during.block_table[:2] != flood.block_table[:2]
        scheduler.check_invariants()
