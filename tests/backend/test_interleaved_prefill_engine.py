"""Nested prefills in the real engine (test model): a quiet tenant's short request sent while a long
prefill step runs gets its first token before that step ends, and both requests' tokens are the ones
each gets alone (greedy) — the proof that the nested step neither reads KV the outer step has not
written nor disturbs it. Requests are sent mid-step through the between-layers hook, not by timing."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest

from ctxgate.backend.engine.api import GenerationDelta, GenerationRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
_salts = itertools.count()


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(
        max_num_batched_tokens=256, max_num_seqs=8, interleaved_prefill_tokens=64, device="cpu"
    )


@pytest.fixture(scope="module")
def long_prompt(tokenizer) -> list[int]:
    words = "river mill harbour lantern orchard granite meadow signal copper ledger window valley".split()
    ids = tokenizer.encode("Summarise these notes: " + " ".join(words[i % len(words)] for i in range(400)))
    assert len(ids) > 300  # two outer steps of 256 tokens
    return ids[:300]


@pytest.fixture(scope="module")
def short_prompt(tokenizer) -> list[int]:
    return tokenizer.encode("Question: name one colour of the rainbow.\nAnswer:")


def alone(engine, prompt: list[int]) -> list[int]:
    """The request's tokens by itself, on a salt of its own (no prefix hit from another run)."""
    deltas = run(engine, [request("alone", prompt)])
    return tokens_of(deltas.all, "alone")


def request(
    request_id: str,
    prompt: list[int],
    tenant: str = "quiet",
    salt: str | None = None,
    arrival: float | None = None,
) -> GenerationRequest:
    return GenerationRequest(
        request_id,
        prompt,
        GREEDY,
        cache_salt=salt or f"salt-{next(_salts)}",
        tenant=tenant,
        arrival_time=arrival,
    )


@dataclass
class Run:
    all: list[GenerationDelta] = field(default_factory=list)
    by_step: list[list[GenerationDelta]] = field(default_factory=list)  # what each step() returned
    mid_step: list[tuple[int, GenerationDelta]] = field(default_factory=list)  # (step, delta) from the hook


def run(
    engine,
    requests: list[GenerationRequest],
    send_mid_step: Callable[[int, int], list[GenerationRequest]] | None = None,
) -> Run:
    """Add `requests`, then step to the end; at every layer boundary `send_mid_step(step, layer)` may
    send more, and a nested prefill may start (what AsyncEngine's hook does)."""
    result = Run()
    step = 0
    layer = itertools.count()

    def hook() -> None:
        for late in send_mid_step(step, next(layer)) if send_mid_step else []:
            engine.add_request(late)
        result.mid_step.extend((step, delta) for delta in engine.prefill_between_layers())

    for item in requests:
        engine.add_request(item)
    engine.model.between_layers = hook
    try:
        while engine.has_unfinished_requests():
            layer = itertools.count()
            deltas = engine.step()
            assert not engine.take_failures()
            engine.scheduler.check_invariants()
            result.by_step.append(deltas)
            step += 1
    finally:
        engine.model.between_layers = None
    result.all = [delta for _, delta in result.mid_step] + [d for ds in result.by_step for d in ds]
    return result


def tokens_of(deltas: list[GenerationDelta], request_id: str) -> list[int]:
    return [token for delta in deltas if delta.request_id == request_id for token in delta.token_ids]


def once_at(step: int, layer: int, *late: GenerationRequest) -> Callable[[int, int], list[GenerationRequest]]:
    return lambda s, i: list(late) if (s, i) == (step, layer) else []


def test_a_short_request_sent_mid_step_gets_its_first_token_before_the_step_ends(
    engine, long_prompt, short_prompt
):
    expected = {"noisy": alone(engine, long_prompt), "quiet": alone(engine, short_prompt)}
    before = engine.interleaved.count
    result = run(
        engine,
        [request("noisy", long_prompt, tenant="noisy")],
        once_at(0, 5, request("quiet", short_prompt)),  # after layer 6 of the first 256-token step
    )
    first_quiet = next(delta for step, delta in result.mid_step if delta.request_id == "quiet")
    assert [step for step, delta in result.mid_step if delta is first_quiet] == [0]
    assert len(first_quiet.token_ids) == 1 and not tokens_of(result.by_step[0], "quiet")
    assert engine.interleaved.count == before + 1
    for request_id, tokens in expected.items():
        assert tokens_of(result.all, request_id) == tokens, request_id


def test_a_nested_request_gets_no_prefix_hit_on_blocks_the_step_is_still_writing(
    engine, long_prompt, tokenizer
):
    """Same salt as the long prompt, its first 48 tokens shared: during the first step those blocks
    are being written (no hit: the whole prompt is computed); during the second they are published
    (a hit). Either way the tokens are the ones it gets alone."""
    shared = long_prompt[:48] + tokenizer.encode(" Now answer: which word came first?")
    assert len(shared) <= 64
    expected = alone(engine, shared)
    for step, hit in ((0, 0), (1, 48)):
        salt = f"shared-{step}"
        late = request(f"late-{step}", shared, salt=salt)
        result = run(
            engine, [request(f"noisy-{step}", long_prompt, tenant="noisy", salt=salt)], once_at(step, 3, late)
        )
        assert [s for s, delta in result.mid_step if delta.request_id == late.request_id][:1] == [step]
        assert tokens_of(result.all, late.request_id) == expected
        final = next(d for d in result.all if d.request_id == late.request_id and d.finish_reason)
        assert final.metrics is not None and final.metrics.cached_prompt_tokens == hit


def test_off_the_short_request_waits_for_the_step(make_engine, long_prompt, short_prompt):
    off = make_engine(max_num_batched_tokens=256, max_num_seqs=8, interleaved_prefill_tokens=0, device="cpu")
    result = run(
        off, [request("noisy", long_prompt, tenant="noisy")], once_at(0, 5, request("quiet", short_prompt))
    )
    assert not result.mid_step and off.interleaved.count == 0
    assert not tokens_of(result.by_step[0], "quiet")
    assert tokens_of(result.all, "quiet") == alone(off, short_prompt)


def test_the_async_engine_takes_a_request_sent_mid_step_and_streams_its_first_token_at_once(
    engine, long_prompt, short_prompt
):
    """Through the engine thread: a side-work job run between two decoder layers of the long
    prompt's prefill has the event loop send the short request and waits until its add is queued;
    at that same layer boundary the engine takes it, prefills it and streams its first token, before
    the long prompt's prefill (and so its first token) is done."""
    from ctxgate.backend.engine.async_engine import AsyncEngine

    expected = alone(engine, short_prompt)

    async def scenario() -> dict[str, GenerationDelta]:
        async_engine = AsyncEngine(engine.config, engine=engine)
        loop = asyncio.get_running_loop()
        queued = threading.Event()
        sent: list[Future[list[GenerationDelta]]] = []

        t0 = time.perf_counter()  # both requests' clock: their TTFTs compare as points in time

        async def send_quiet() -> list[GenerationDelta]:
            quiet = request("quiet", short_prompt, arrival=t0)
            accepted = asyncio.ensure_future(async_engine.add_request(quiet))
            await asyncio.sleep(0)  # add_request ran to its first await: the add is queued
            queued.set()
            return [delta async for delta in await accepted]

        def job() -> bool:  # on the engine thread: sends the request if a prefill step is running
            if (
                not engine.interleaved.in_outer_step
                or engine.sequences["noisy"].sequences[0].num_output_tokens
            ):
                return False
            sent.append(asyncio.run_coroutine_threadsafe(send_quiet(), loop))
            assert queued.wait(10)
            return True

        try:
            noisy = await async_engine.add_request(request("noisy", long_prompt, tenant="noisy", arrival=t0))
            while not await asyncio.wrap_future(async_engine.run_between_steps(job)):
                await asyncio.sleep(0.005)
            noisy_deltas = [delta async for delta in noisy]
            quiet_deltas = await asyncio.wrap_future(sent[0])
            assert [t for d in quiet_deltas for t in d.token_ids] == expected
            return {"noisy": noisy_deltas[-1], "quiet": quiet_deltas[-1]}
        finally:
            await async_engine.stop()
            engine.model.between_layers = None

    before = engine.interleaved.count
    last = asyncio.run(scenario())
    quiet, noisy = last["quiet"].metrics, last["noisy"].metrics
    assert quiet is not None and noisy is not None
    assert quiet.ttft_ms < noisy.ttft_ms  # sent during the noisy prefill, its first token came first
    assert engine.interleaved.count == before + 1


def test_on_the_bfloat16_kernel_path_the_nested_request_answers_as_alone(
    make_engine, long_prompt, short_prompt
):
    """The production CPU path: fused C++ layers and traced decode steps where this CPU has them
    (their static buffers are never used by a nested step, which runs eagerly)."""
    fast = make_engine(
        dtype="bfloat16",
        max_num_batched_tokens=256,
        max_num_seqs=8,
        interleaved_prefill_tokens=64,
        device="cpu",
    )
    expected = alone(fast, short_prompt)
    result = run(
        fast, [request("noisy", long_prompt, tenant="noisy")], once_at(0, 5, request("quiet", short_prompt))
    )
    assert [step for step, delta in result.mid_step if delta.request_id == "quiet"][:1] == [0]
    assert tokens_of(result.all, "quiet") == expected
