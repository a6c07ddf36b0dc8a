"""Weighted fair queuing between tenants in the scheduler (no model: steps are simulated, invariants
checked after each call), then the same order through the real engine on the test model."""

from __future__ import annotations

import itertools
import math

import pytest

from ctxgate.backend.engine.api import EngineError, GenerationRequest, Priority, SamplingParams
from ctxgate.backend.engine.block_manager import BlockManager
from ctxgate.backend.engine.scheduler import Scheduler
from ctxgate.backend.engine.sequence import Sequence
from tests.backend.test_scheduler import BLOCK, finish_step, schedule

_orders = itertools.count()


def tenant_seq(
    tenant: str | None, num_tokens: int, weight: float = 1.0, priority: Priority = Priority.USER
) -> Sequence:
    order = next(_orders)
    return Sequence(
        request_id=f"{tenant}-{order}",
        prompt_token_ids=[order % 50 + 1] * num_tokens,
        sampling=SamplingParams(max_tokens=1),
        max_tokens=1,
        arrival_order=order,
        priority=priority,
        tenant=tenant,
        weight=weight,
    )


def make_scheduler(budget: int, fair: bool = True, num_blocks: int = 512, max_seqs: int = 8) -> Scheduler:
    manager = BlockManager(num_blocks, BLOCK, enable_prefix_caching=False)
    return Scheduler(manager, budget, max_seqs, ttft_target_ms=1e9, fair_queuing=fair)


def admissions(scheduler: Scheduler, steps: int) -> list[Sequence]:
    """Run `steps` steps, finishing each sequence at its first token; the sequences in the order
    their prefill started."""
    started: list[Sequence] = []
    for _ in range(steps):
        output = schedule(scheduler)
        started.extend(item.seq for item in output.scheduled if item.seq.num_computed_tokens == 0)
        finish_step(scheduler, output)
        for item in output.scheduled:
            if item.seq.num_output_tokens >= item.seq.max_tokens:
                scheduler.remove(item.seq)
        scheduler.check_invariants()
    return started


@pytest.mark.parametrize("fair", [True, False])
def test_a_quiet_tenants_request_is_scheduled_before_a_flooding_tenants_backlog(fair: bool):
    scheduler = make_scheduler(budget=16, fair=fair)
    flood = [tenant_seq("a", 16) for _ in range(10)]
    for seq in flood:
        scheduler.add(seq)
    assert admissions(scheduler, 2) == flood[:2]
    quiet = tenant_seq("b", 4)
    scheduler.add(quiet)
    order = admissions(scheduler, 9)
    if fair:  # b starts at the system's virtual time and finishes ahead of a's queued requests
        assert order[0] is quiet
    else:  # first come, first served: b waits behind a's whole backlog
        assert order[-1] is quiet and order[:-1] == flood[2:]


def test_weights_give_proportional_prefill_shares():
    scheduler = make_scheduler(budget=8)
    for _ in range(40):
        scheduler.add(tenant_seq("light", 8, weight=1.0))
        scheduler.add(tenant_seq("heavy", 8, weight=3.0))
    order = admissions(scheduler, 40)  # one 8-token prompt per step: 40 of the 80 start
    tokens = {"light": 0, "heavy": 0}
    for seq in order:
        tokens[seq.tenant] += seq.num_prompt_tokens
    assert len(order) == 40
    assert 2.5 <= tokens["heavy"] / tokens["light"] <= 3.5, tokens
    # Equal weights and unequal prompt lengths: shares of prefill tokens, not of requests.
    scheduler = make_scheduler(budget=32)
    for _ in range(30):
        scheduler.add(tenant_seq("long", 32))
        for _ in range(4):
            scheduler.add(tenant_seq("short", 8))
    order = admissions(scheduler, 30)
    tokens = {"long": 0, "short": 0}
    for seq in order:
        tokens[seq.tenant] += seq.num_prompt_tokens
    assert 0.75 <= tokens["long"] / tokens["short"] <= 1.34, tokens


def test_priority_classes_come_first_then_fair_order_inside_each():
    scheduler = make_scheduler(budget=8)
    a_background = tenant_seq("a", 8, priority=Priority.BACKGROUND)
    a_user = [tenant_seq("a", 8) for _ in range(3)]
    b_background = tenant_seq("b", 8, priority=Priority.BACKGROUND)
    b_user = tenant_seq("b", 8)
    for seq in (a_background, *a_user, b_background, b_user):
        scheduler.add(seq)
    order = admissions(scheduler, 6)
    # Every user request before any background one. Each tenant's background request was charged to
    # its clock first, so b's user request ties a's first in virtual finish (16) and comes after it
    # by arrival, ahead of a's backlog.
    assert order == [a_user[0], b_user, a_user[1], a_user[2], a_background, b_background]


def test_an_idle_tenant_banks_no_credit():
    scheduler = make_scheduler(budget=8)
    busy = [tenant_seq("a", 8) for _ in range(30)]
    for seq in busy:
        scheduler.add(seq)
    admissions(scheduler, 20)  # b sends nothing while a runs 20 requests
    virtual_time = scheduler.fair.virtual_time
    assert virtual_time > 0
    back = [tenant_seq("b", 8) for _ in range(5)]
    for seq in back:
        scheduler.add(seq)
    # Clamped: b starts at the system's virtual time, its idle stretch counts for nothing.
    assert back[0].virtual_finish == virtual_time + 8
    order = admissions(scheduler, 8)
    # Alternating from there (a first on ties: it arrived first), not b's five first, which 20
    # unused turns of credit would give.
    assert [seq.tenant for seq in order] == ["a", "b"] * 4


def test_a_returning_tenant_starts_afresh_once_the_queue_drained():
    scheduler = make_scheduler(budget=64)
    for _ in range(4):
        scheduler.add(tenant_seq("a", 8))
    admissions(scheduler, 2)
    assert not scheduler.waiting and scheduler.fair.num_tenants == 0
    late_a, late_b = tenant_seq("a", 8), tenant_seq("b", 8)
    scheduler.add(late_a)
    scheduler.add(late_b)
    assert late_a.virtual_finish == late_b.virtual_finish == scheduler.fair.virtual_time + 8


def test_preemption_takes_the_sequence_latest_in_virtual_time():
    # 6 blocks of 4 tokens, three 8-token prompts: the pool is full after their prefill.
    for fair, expected in ((True, "a"), (False, "b")):
        scheduler = make_scheduler(budget=64, fair=fair, num_blocks=6)
        a_first, a_second, b_only = tenant_seq("a", 8), tenant_seq("a", 8), tenant_seq("b", 8)
        for seq in (a_first, a_second, b_only):
            scheduler.add(seq)
        finish_step(scheduler, schedule(scheduler))
        output = schedule(scheduler)  # each needs a third block: someone is preempted
        victim = output.preempted[0]
        # Fair: a's second request (virtual finish 16), not b's newer one (virtual finish 8).
        assert victim.tenant == expected
        assert victim.virtual_finish == (16.0 if fair else 0.0)
        assert victim in scheduler.waiting  # back in the queue with the start it had


def test_tenants_remembered_stay_bounded_under_one_shot_tenants():
    scheduler = make_scheduler(budget=16)
    for _ in range(400):
        scheduler.add(tenant_seq("flood", 8))
    for index in range(300):  # each step a request from a tenant never seen again
        scheduler.add(tenant_seq(f"once-{index}", 8))
        admitted = admissions(scheduler, 1)
        # Neither starves the other: the newcomer gets in at once, and virtual time moves on, so
        # the flood's next request keeps its turn.
        assert sorted(seq.tenant for seq in admitted) == ["flood", f"once-{index}"]
        assert scheduler.fair.num_tenants <= 66
    assert scheduler.waiting  # never drained: pruning alone bounds the memory


# ---- the real engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(make_engine):
    # A step takes one 96-token prompt: admission order is visible as the order of first tokens.
    return {
        fair: make_engine(max_num_batched_tokens=96, fair_queuing=fair, enable_prefix_caching=False)
        for fair in (True, False)
    }


def first_token_order(engine, requests: list[GenerationRequest]) -> list[str]:
    for request in requests:
        engine.add_request(request)
    order: list[str] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.token_ids and delta.request_id not in order:
                order.append(delta.request_id)
        engine.scheduler.check_invariants()
    return order


@pytest.mark.parametrize("fair", [True, False])
def test_the_engine_serves_a_quiet_tenant_before_a_flooding_tenants_backlog(engines, tokenizer, fair: bool):
    engine = engines[fair]
    long_prompt = tokenizer.encode("The river runs past the old mill and on to the sea. " * 8)[:96]
    assert len(long_prompt) == 96
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    flood = [GenerationRequest(f"a{index}-{fair}", long_prompt, sampling, tenant="a") for index in range(6)]
    quiet = GenerationRequest(f"b-{fair}", tokenizer.encode("Hi there"), sampling, tenant="b")
    order = first_token_order(engine, [*flood, quiet])
    if fair:
        assert order.index(quiet.request_id) <= 1
    else:
        assert order[-1] == quiet.request_id


@pytest.mark.parametrize("weight", [0, -1, math.nan, math.inf, 1001, True])
def test_the_engine_refuses_a_weight_out_of_range_naming_it(engines, weight):
    request = GenerationRequest("w", [1, 2, 3], SamplingParams(max_tokens=1), tenant="a", weight=weight)
    with pytest.raises(EngineError) as info:
        engines[True].add_request(request)
    assert (info.value.status_code, info.value.param) == (400, "weight")
    assert not engines[True].has_unfinished_requests()
