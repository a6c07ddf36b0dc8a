"""Compress-to-fit through HTTP, real engine and in-process ledger: a tenant with a small
tokens-per-minute quota sending 20-passage NQ requests is fitted into what it has left until the
floor (fit.quota: compress) or refused as before (reject); a prompt over max_input_tokens under a
policy that does not compress is fitted instead of 413, its system prompt and question intact."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from ctxgate.eval.datasets import load_dataset, resolve_dataset_path
from ctxgate.gateway.app import create_app
from ctxgate.gateway.quota import QuotaLimits, create_store
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.clock import FakeClock
from tests.support.servers import ServerThread, write_policy

START = 1_700_000_040.0 + 5  # 5 s into a minute, far from the end of the UTC day
TPM = 2_500
FLOOR = 200
MAX_INPUT = 1_024
OUTPUT = 8
SYSTEM = "You answer questions from the passages. Reply with a short phrase."
CHEAP = "rerank: {method: bm25}\ndedup: {near_duplicate_cosine: null}\n"


def _quota_policy(name: str, fit: str) -> str:
    return (
        f"name: {name}\nmax_input_tokens: {MAX_INPUT}\nreserve_output_tokens: {OUTPUT}\n"
        f"documents: {{max_tokens: 900}}\nquota: {{tokens_per_minute: {TPM}}}\n{CHEAP}{fit}"
    )


@pytest.fixture(scope="module")
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fit")
    write_policy(
        directory, "fitq", _quota_policy("fitq", f"fit: {{quota: compress, min_context_tokens: {FLOOR}}}\n")
    )
    write_policy(directory, "rejectq", _quota_policy("rejectq", ""))
    raw = "reserve_output_tokens: 4\ncompression_enabled: false\ndocuments: {max_tokens: 400}\n" + CHEAP
    write_policy(
        directory, "raw", f"name: raw\nmax_input_tokens: 600\n{raw}fit: {{max_input_tokens: compress}}\n"
    )
    write_policy(directory, "raw-reject", f"name: raw-reject\nmax_input_tokens: 600\n{raw}")
    # Over the model's 2,048-token window: fit_to_model caps the budget at the window.
    write_policy(
        directory,
        "raw-window",
        f"name: raw-window\nmax_input_tokens: 4096\n{raw}fit: {{context_window: compress}}\n",
    )
    cap = (
        f"max_input_tokens: {MAX_INPUT}\nreserve_output_tokens: 256\ndocuments: {{max_tokens: 900}}\n{CHEAP}"
    )
    fit = f"fit: {{quota: compress, min_context_tokens: {FLOOR}}}\n"
    write_policy(directory, "fitcap", f"name: fitcap\n{cap}quota: {{tokens_per_minute: 300}}\n{fit}")
    write_policy(directory, "fitpin", f"name: fitpin\n{cap}quota: {{tokens_per_minute: 450}}\n{fit}")
    return directory


@contextmanager
def _serving(engine, policy_dir, clock, redis_url: str | None = None) -> Iterator[ServerThread]:
    app = create_app(GatewaySettings(policy_dir=policy_dir, redis_url=redis_url), engine=engine, clock=clock)
    with ServerThread(app) as running:
        running.store = app.state.gateway.store
        # The test reads the ledger from its own event loops: a Redis client is bound to the loop it
        # first ran on (the server's), so each read gets a fresh client on the same ledger.
        running.ledger = (lambda: create_store(redis_url, clock)) if redis_url else (lambda: running.store)
        yield running


@pytest.fixture(scope="module")
def server(engine, policy_dir, clock):
    with _serving(engine, policy_dir, clock) as running:
        yield running


@pytest.fixture(scope="module")
def examples():
    return load_dataset(resolve_dataset_path("nq-multidoc-dev.jsonl"), limit=12).examples


def _request(example, policy: str, max_tokens: int = OUTPUT) -> dict:
    return {
        "model": "SmolLM2-135M-Instruct",
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example.question}],
        "ctxgate": {"policy": policy, "documents": example.documents()},
    }


def _chat(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)


def _tokens_this_minute(server) -> int:
    (minute,) = asyncio.run(server.ledger().usage("anonymous", QuotaLimits(tokens_per_minute=TPM)))
    return minute.used


def _room(server) -> int:
    return asyncio.run(server.ledger().tokens_left("anonymous", QuotaLimits(tokens_per_minute=TPM)))


def _fit_metric(server, policy: str, outcome: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if (
            line.startswith("ctxgate:fit_requests_total{")
            and f'policy="{policy}"' in line
            and f'outcome="{outcome}"' in line
            and 'limit="quota"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_burst_is_fitted_into_the_quota_until_the_floor(server, clock, examples):
    clock.advance(61)  # every second of the sliding minute has left it
    responses = []
    for example in examples:
        responses.append(_chat(server, _request(example, "fitq")))
        if responses[-1].status_code != 200:
            break
    statuses = [r.status_code for r in responses]
    assert statuses[-1] == 429 and set(statuses[:-1]) == {200}, [r.text[:300] for r in responses]
    fits = [r.json()["usage"]["ctxgate"].get("fit") for r in responses[:-1]]
    assert fits[0] is None  # a fresh window holds the first request at the policy's normal budget
    fitted = [(r.json()["usage"], fit) for r, fit in zip(responses, fits, strict=False) if fit is not None]
    assert fitted, "the quota's remainder was never used by a fitted request"
    for usage, fit in fitted:
        assert fit["bound_by"] == "quota"
        assert FLOOR <= fit["budget"] < MAX_INPUT
        assert fit["would_have_needed"] == MAX_INPUT + OUTPUT  # the early check's figure at the normal budget
        assert usage["prompt_tokens"] <= fit["budget"]
    # Served until what is left could not give the prompt the floor and one output token.
    assert _room(server) <= FLOOR
    refusal = responses[-1].json()["error"]
    assert (
        refusal["code"] == "tokens_per_minute" and f"needs {MAX_INPUT + OUTPUT} tokens" in refusal["message"]
    )
    assert "min_context_tokens" in refusal["message"]
    assert _tokens_this_minute(server) <= TPM
    assert _fit_metric(server, "fitq", "fitted") == len(fitted)
    assert _fit_metric(server, "fitq", "refused") >= 1


def test_with_reject_the_quota_refuses_as_before(server, clock, examples):
    clock.advance(61)
    responses = []
    for example in examples:
        responses.append(_chat(server, _request(example, "rejectq")))
        if responses[-1].status_code != 200:
            break
    statuses = [r.status_code for r in responses]
    assert statuses[-1] == 429 and set(statuses[:-1]) == {200} and len(statuses) >= 3
    assert all("fit" not in r.json()["usage"]["ctxgate"] for r in responses[:-1])
    error = responses[-1].json()["error"]
    assert error["code"] == "tokens_per_minute" and "min_context_tokens" not in error["message"]
    # Refused at the normal size (1,032 tokens) with room a fitted request would have used.
    assert FLOOR < _room(server) < MAX_INPUT + OUTPUT
    assert _fit_metric(server, "rejectq", "refused") == 1


def _concurrent_burst(server, examples) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(
                *(
                    client.post(f"{server.url}/v1/chat/completions", json=_request(example, "fitq"))
                    for example in examples[:6]
                )
            )

    responses = asyncio.run(burst())
    assert {r.status_code for r in responses} <= {200, 429}, [r.text[:300] for r in responses]
    served = [r.json()["usage"] for r in responses if r.status_code == 200]
    assert len(served) >= 2
    for usage in served:
        fit = usage["ctxgate"].get("fit")
        if fit is not None:
            assert fit["bound_by"] == "quota"
            assert fit["budget"] >= FLOOR and usage["prompt_tokens"] <= fit["budget"]
    assert _tokens_this_minute(server) <= TPM + MAX_INPUT + OUTPUT


def test_a_concurrent_burst_never_overdraws_the_window_by_more_than_one_reservation(server, clock, examples):
    clock.advance(61)
    _concurrent_burst(server, examples)


def test_the_same_burst_on_the_redis_ledger(engine, policy_dir, clock, examples, redis_server):
    clock.advance(61)
    with _serving(engine, policy_dir, clock, redis_server.url) as server:
        assert server.store.name == "redis"
        _concurrent_burst(server, examples)


def test_a_prompt_over_max_input_tokens_is_fitted_with_system_prompt_and_question_intact(server, examples):
    example = examples[0]
    refused = _chat(server, _request(example, "raw-reject", max_tokens=4))
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "prompt_too_long"

    response = _chat(server, _request(example, "raw", max_tokens=4))
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    fit = usage["ctxgate"]["fit"]
    assert fit["bound_by"] == "max_input_tokens" and fit["budget"] == 600
    assert fit["would_have_needed"] == usage["ctxgate"]["original_prompt_tokens"] > 600
    assert usage["prompt_tokens"] <= 600

    compressed = httpx.post(
        f"{server.url}/v1/ctxgate/compress", json=_request(example, "raw"), timeout=300
    ).json()
    assert compressed["report"]["fit"]["bound_by"] == "max_input_tokens"
    messages = compressed["messages"]
    assert messages[0] == {"role": "system", "content": SYSTEM}
    assert messages[-1]["role"] == "user" and example.question in messages[-1]["content"]
    assert compressed["report"]["prompt_tokens"] <= 600 < compressed["report"]["original_prompt_tokens"]


def test_a_prompt_over_the_models_window_is_fitted_into_it(server, examples):
    response = _chat(server, _request(examples[1], "raw-window", max_tokens=4))
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    fit = usage["ctxgate"]["fit"]
    # The window (2,048) minus the output reservation (4).
    assert fit == {
        "bound_by": "context_window",
        "budget": 2_044,
        "would_have_needed": fit["would_have_needed"],
    }
    assert fit["would_have_needed"] == usage["ctxgate"]["original_prompt_tokens"] > 2_048
    assert usage["prompt_tokens"] <= 2_044


def test_output_alone_over_the_remainder_is_capped_so_the_prompt_keeps_the_floor(server, clock, examples):
    clock.advance(61)
    body = _request(examples[2], "fitcap", max_tokens=256) | {"ignore_eos": True}
    response = _chat(server, body)
    assert response.status_code == 200, response.text
    answer = response.json()
    # 300 tokens left: 256 of output would leave the prompt 44, under the floor of 200; so the
    # prompt gets the floor and max_tokens what remains (100), ending as any capped answer does.
    assert answer["usage"]["ctxgate"]["fit"] == {
        "bound_by": "quota",
        "budget": FLOOR,
        "would_have_needed": 1_024 + 256,
    }
    assert answer["usage"]["completion_tokens"] == 100 and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] <= FLOOR
    assert _tokens_this_minute(server) <= 300


def test_a_fit_the_system_prompt_alone_does_not_fit_is_the_quota_refusal_saying_what_was_needed(
    server, clock, examples
):
    clock.advance(61)
    body = _request(examples[3], "fitpin")
    body["messages"][0]["content"] = SYSTEM + " Cite the passage you used." * 90  # ~620 tokens, never cut
    response = _chat(server, body)
    assert response.status_code == 429
    error = response.json()["error"]
    assert error["code"] == "tokens_per_minute" and response.headers["retry-after"]
    assert "prompt budget of 442 tokens" in error["message"] and "would have needed 1032" in error["message"]
    assert "system prompt and question alone take" in error["message"]
    assert _tokens_this_minute(server) == 0
