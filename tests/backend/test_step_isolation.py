"""Step isolation: a sequence that makes the step raise is aborted alone; its neighbours finish as if
it had never been there, and the scheduler and KV pool stay consistent.

The failing sequences are made by changing a request's state after admission (its sampling fields,
a prompt token, its detokenizer): admission would refuse such values, and this is what the step
must survive should anything slip past it.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest

from ctxgate.backend.engine.api import EngineError, GenerationRequest, SamplingParams

PROMPT = [1, 504, 3458, 282, 4649, 314]
VICTIMS = {
    "greedy": SamplingParams(max_tokens=8, temperature=0),
    # Seeded: its draws come from its own generator, which a failing neighbour must not move on.
    "seeded": SamplingParams(max_tokens=8, temperature=0.9, seed=11),
}


@pytest.fixture(scope="module")
def engine(make_engine):
    # On a GPU an out-of-range index is a device-side assert that ends the CUDA context: there no
    # retry can recover, and admission is the only guard. The recovery is tested where it can run.
    return make_engine(max_num_seqs=8, device="cpu")


@pytest.fixture(scope="module")
def alone(engine) -> dict[str, list[int]]:
    """Each victim's tokens when it runs by itself."""
    return {name: engine.generate([PROMPT], params)[0] for name, params in VICTIMS.items()}


def _poison_sampling(engine, request_id: str, **fields) -> None:
    for seq in engine.sequences[request_id].sequences:
        seq.sampling = replace(seq.sampling, **fields)


def _run(
    engine, requests: dict[str, SamplingParams], poison, after_steps: int = 0
) -> tuple[dict[str, list[int]], dict[str, EngineError]]:
    """Add every request, poison some after admission (and `after_steps` steps), step to the end;
    (tokens, failures) by request id."""
    for request_id, params in requests.items():
        engine.add_request(GenerationRequest(request_id, PROMPT, params))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    failures: dict[str, EngineError] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == after_steps:
            poison(engine)
        steps += 1
        engine.scheduler.check_invariants()
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
        failures.update(engine.take_failures())
    engine.scheduler.check_invariants()
    assert not engine.sequences
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked
    return tokens, failures


SAMPLING_POISONS = [
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.nan, "seed": 5}, "temperature"),
    ({"top_k": 2**63, "temperature": 1.0}, "temperature"),
    ({"stop_token_ids": [1_000_000_000], "min_tokens": 5}, "min_tokens"),
    ({"logit_bias": {1_000_000_000: 1.0}}, "logit_bias"),
]


@pytest.mark.parametrize(("poison", "param"), SAMPLING_POISONS, ids=[p for _, p in SAMPLING_POISONS])
def test_a_request_whose_sampling_raises_fails_alone(engine, alone, poison, param):
    # "late" is admitted after the culprit: its place in the batch is behind the failing row.
    requests = {
        "greedy": VICTIMS["greedy"],
        "bad": SamplingParams(max_tokens=8, seed=3),
        "seeded": VICTIMS["seeded"],
        "late": VICTIMS["greedy"],
    }
    tokens, failures = _run(engine, requests, lambda e: _poison_sampling(e, "bad", **poison))
    assert tokens["greedy"] == tokens["late"] == alone["greedy"]
    assert tokens["seeded"] == alone["seeded"]
    assert set(failures) == {"bad"}
    assert (failures["bad"].status_code, failures["bad"].param) == (400, param)
    assert tokens["bad"] == []


def test_a_choice_that_fails_ends_its_whole_request(engine, alone):
    """n = 3: the choices fork after the prompt; one failing ends the request (and frees every
    choice's blocks), not the neighbour."""
    requests = {"victim": VICTIMS["greedy"], "bad": SamplingParams(max_tokens=8, n=3, seed=3)}

    def poison(e):
        assert len(e.sequences["bad"].sequences) == 3  # forked after the first token
        _poison_sampling(e, "bad", stop_token_ids=[1_000_000_000], min_tokens=5)

    tokens, failures = _run(engine, requests, poison, after_steps=2)
    assert tokens["victim"] == alone["greedy"]
    assert set(failures) == {"bad"}


def test_a_request_whose_forward_pass_raises_fails_alone(engine, alone):
    """A token id past the embedding table: the batched forward raises, the batch is bisected, and
    only that sequence is aborted (a 500: the model failed, not a field the client sent)."""
    requests = {"victim": VICTIMS["greedy"], "bad": SamplingParams(max_tokens=8), "seeded": VICTIMS["seeded"]}

    def poison(e):
        e.sequences["bad"].sequences[0].token_ids[2] = 1_000_000_000

    tokens, failures = _run(engine, requests, poison)
    assert tokens["victim"] == alone["greedy"]
    assert tokens["seeded"] == alone["seeded"]
    assert set(failures) == {"bad"} and failures["bad"].status_code == 500


def test_a_request_whose_output_handling_raises_fails_alone(engine, alone):
    requests = {"victim": VICTIMS["greedy"], "bad": SamplingParams(max_tokens=8)}

    def poison(e):
        e.sequences["bad"].sequences[0].detokenizer = None

    tokens, failures = _run(engine, requests, poison)
    assert tokens["victim"] == alone["greedy"]
    assert set(failures) == {"bad"} and failures["bad"].status_code == 500


def test_the_async_engine_fails_only_the_culprits_stream(engine, alone):
    """Through the engine thread: the culprit's consumer gets its 400, the victim's stream runs on,
    and the engine stays ready for the next request."""
    from ctxgate.backend.engine.async_engine import AsyncEngine

    long_victim = replace(VICTIMS["greedy"], max_tokens=24, ignore_eos=True)
    [long_alone] = engine.generate([PROMPT], long_victim)

    async def scenario() -> None:
        async_engine = AsyncEngine(engine.config, engine=engine)
        try:
            victim = await async_engine.add_request(GenerationRequest("victim", PROMPT, long_victim))
            bad = await async_engine.add_request(
                GenerationRequest("bad", PROMPT, SamplingParams(max_tokens=8))
            )
            # On the engine thread, between two steps: the request is admitted, then made to fail.
            await asyncio.wrap_future(
                async_engine.run_between_steps(lambda: _poison_sampling(engine, "bad", temperature=math.nan))
            )
            with pytest.raises(EngineError) as failed:
                async for _ in bad:
                    pass
            assert (failed.value.status_code, failed.value.param) == (400, "temperature")
            victim_tokens = [token async for delta in victim for token in delta.token_ids]
            assert victim_tokens == long_alone
            assert async_engine.is_ready()
            after = [
                token
                async for delta in async_engine.generate(
                    GenerationRequest("after", PROMPT, VICTIMS["greedy"])
                )
                for token in delta.token_ids
            ]
            assert after == alone["greedy"]
        finally:
            await async_engine.stop()
            engine.model.between_layers = None

    asyncio.run(scenario())
