"""Compress-to-fit into the tenant's remaining spend, through HTTP with the real engine: when what
is left of `spend_per_day` cannot pay for a 20-passage NQ request at the normal budget, the request
is fitted into the tokens the remainder buys at the policy's prices (fit.spend: compress), until
the floor; with `reject` the spend limit refuses as before."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ctxgate.eval.datasets import load_dataset, resolve_dataset_path
from ctxgate.gateway.app import create_app
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.clock import FakeClock
from tests.support.servers import ServerThread, write_policy

START = 1_700_000_040.0 + 5  # 5 s into a minute, far from the end of the UTC day
DAY = 86_400
FLOOR = 200
MAX_INPUT = 1_024
OUTPUT = 8
# $1 per 1,000 prompt tokens, $4 per 1,000 output tokens; $3 a day: about three requests.
SPEND = 3.0
SYSTEM = "You answer questions from the passages. Reply with a short phrase."
POLICY = (
    f"max_input_tokens: {MAX_INPUT}\nreserve_output_tokens: {OUTPUT}\ndocuments: {{max_tokens: 900}}\n"
    "rerank: {method: bm25}\ndedup: {near_duplicate_cosine: null}\n"
    f"cost: {{prompt_per_1k: 1.0, completion_per_1k: 4.0}}\nquota: {{spend_per_day: {SPEND}}}\n"
)


@pytest.fixture(scope="module")
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory, clock):
    directory = tmp_path_factory.mktemp("fit-spend")
    write_policy(
        directory, "fits", f"name: fits\n{POLICY}fit: {{spend: compress, min_context_tokens: {FLOOR}}}\n"
    )
    write_policy(directory, "rejects", f"name: rejects\n{POLICY}")
    app = create_app(GatewaySettings(policy_dir=directory), engine=engine, clock=clock)
    with ServerThread(app) as running:
        running.store = app.state.gateway.store
        yield running


@pytest.fixture(scope="module")
def examples():
    return load_dataset(resolve_dataset_path("nq-multidoc-dev.jsonl"), limit=10).examples


def _burst(server, examples, policy: str) -> list[httpx.Response]:
    responses = []
    for example in examples:
        body = {
            "model": "SmolLM2-135M-Instruct",
            "max_tokens": OUTPUT,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": example.question},
            ],
            "ctxgate": {"policy": policy, "documents": example.documents()},
        }
        responses.append(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300))
        if responses[-1].status_code != 200:
            break
    return responses


def _spent_micros(server) -> int:
    from ctxgate.gateway.quota import QuotaLimits

    usage = asyncio.run(server.store.usage("anonymous", QuotaLimits(spend_per_day=SPEND)))
    return next(limit.used for limit in usage if limit.name == "spend_per_day")


def _fit_metric(server, policy: str, outcome: str) -> float:
    lines = [
        line
        for line in httpx.get(f"{server.url}/metrics").text.splitlines()
        if line.startswith("ctxgate:fit_requests_total{")
        and f'policy="{policy}"' in line
        and 'limit="spend"' in line
        and f'outcome="{outcome}"' in line
    ]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_a_burst_is_fitted_into_the_spend_left_until_the_floor(server, clock, examples):
    clock.advance(DAY)
    responses = _burst(server, examples, "fits")
    statuses = [r.status_code for r in responses]
    assert statuses[-1] == 429 and set(statuses[:-1]) == {200}, [r.text[:300] for r in responses]
    usages = [r.json()["usage"] for r in responses[:-1]]
    assert usages[0]["ctxgate"].get("fit") is None  # a fresh day pays for the normal budget
    fitted = [u for u in usages if "fit" in u["ctxgate"]]
    assert fitted, "the spend left was never used by a fitted request"
    for usage in fitted:
        fit = usage["ctxgate"]["fit"]
        assert fit["bound_by"] == "spend" and fit["would_have_needed"] == MAX_INPUT + OUTPUT
        assert FLOOR <= fit["budget"] < MAX_INPUT and usage["prompt_tokens"] <= fit["budget"]
    # The fitted requests' prompts got what the remainder bought: a budget under the normal one
    # that the spend left after the earlier requests could pay for, output included.
    spent = sum(u["ctxgate"]["cost"] for u in usages)
    assert spent <= SPEND and _spent_micros(server) == pytest.approx(spent * 1e6, abs=len(usages))
    refusal = responses[-1].json()["error"]
    assert refusal["code"] == "spend_per_day" and "min_context_tokens" in refusal["message"]
    # Under the floor: what is left cannot buy the floor's prompt and the output.
    assert SPEND * 1e6 - _spent_micros(server) < (FLOOR * 1.0 + OUTPUT * 4.0) * 1_000
    assert _fit_metric(server, "fits", "fitted") == len(fitted)
    assert _fit_metric(server, "fits", "refused") >= 1


def test_with_reject_the_spend_limit_refuses_as_before(server, clock, examples):
    clock.advance(DAY)
    responses = _burst(server, examples, "rejects")
    assert responses[-1].status_code == 429 and len(responses) >= 3
    assert all("fit" not in r.json()["usage"]["ctxgate"] for r in responses[:-1])
    error = responses[-1].json()["error"]
    assert error["code"] == "spend_per_day" and "min_context_tokens" not in error["message"]
    # Refused with room left that a fitted request would have used.
    assert SPEND * 1e6 - _spent_micros(server) > (FLOOR * 1.0 + OUTPUT * 4.0) * 1_000
