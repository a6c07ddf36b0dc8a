"""Compress-to-fit in upstream mode: the gateway in front of a real upstream server (the engine's
own OpenAI server) fits a tenant's 20-passage NQ burst into its tokens per minute until the floor,
and a prompt over max_input_tokens into the budget; the upstream's own token counts settle the
quota, and the segments add up to them."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ctxgate.eval.datasets import load_dataset, resolve_dataset_path
from ctxgate.gateway.app import create_app
from ctxgate.gateway.quota import QuotaLimits
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.clock import FakeClock
from tests.support.servers import ServerThread, serve_engine, write_policy

START = 1_700_000_040.0 + 5
MODEL = "SmolLM2-135M-Instruct"
TPM = 2_500
FLOOR = 200
MAX_INPUT = 1_024
OUTPUT = 8
SYSTEM = "You answer questions from the passages. Reply with a short phrase."
CHEAP = "rerank: {method: bm25}\ndedup: {near_duplicate_cosine: null}\n"


@pytest.fixture(scope="module")
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture(scope="module")
def front(engine, model_dir, tmp_path_factory, clock):
    directory = tmp_path_factory.mktemp("fit-upstream")
    write_policy(
        directory,
        "fitq",
        f"name: fitq\nmax_input_tokens: {MAX_INPUT}\nreserve_output_tokens: {OUTPUT}\n"
        f"documents: {{max_tokens: 900}}\nquota: {{tokens_per_minute: {TPM}}}\n{CHEAP}"
        f"fit: {{quota: compress, min_context_tokens: {FLOOR}}}\n",
    )
    write_policy(
        directory,
        "raw",
        f"name: raw\nmax_input_tokens: 600\nreserve_output_tokens: 4\ncompression_enabled: false\n"
        f"documents: {{max_tokens: 400}}\n{CHEAP}fit: {{max_input_tokens: compress}}\n",
    )
    with serve_engine(engine, manage_engine=False) as url:
        settings = GatewaySettings(
            policy_dir=directory, upstreams=[f"{url}/v1"], served_model_name=MODEL, tokenizer=str(model_dir)
        )
        app = create_app(settings, clock=clock)
        with ServerThread(app) as running:
            running.store = app.state.gateway.store
            yield running


@pytest.fixture(scope="module")
def examples():
    return load_dataset(resolve_dataset_path("nq-multidoc-dev.jsonl"), limit=12).examples


def _chat(front, example, policy: str, max_tokens: int = OUTPUT) -> httpx.Response:
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example.question}],
        "ctxgate": {"policy": policy, "documents": example.documents()},
    }
    return httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=300)


def test_an_upstream_burst_is_fitted_into_the_quota_until_the_floor(front, clock, examples):
    clock.advance(60)
    responses = []
    for example in examples:
        responses.append(_chat(front, example, "fitq"))
        if responses[-1].status_code != 200:
            break
    statuses = [r.status_code for r in responses]
    assert statuses[-1] == 429 and set(statuses[:-1]) == {200}, [r.text[:300] for r in responses]
    usages = [r.json()["usage"] for r in responses[:-1]]
    fitted = [u for u in usages if "fit" in u["ctxgate"]]
    assert fitted
    for usage in fitted:
        fit = usage["ctxgate"]["fit"]
        assert fit["bound_by"] == "quota" and FLOOR <= fit["budget"] < MAX_INPUT
        assert usage["prompt_tokens"] <= fit["budget"]
    for usage in usages:  # the upstream's own counts, split into segments exactly
        segments = usage["ctxgate"]["segments"]
        assert sum(v["after"] for k, v in segments.items() if k != "output") == usage["prompt_tokens"]
    [window] = asyncio.run(front.store.usage("anonymous", QuotaLimits(tokens_per_minute=TPM)))
    used = window.used
    assert used == sum(u["prompt_tokens"] + u["completion_tokens"] for u in usages) <= TPM
    left = asyncio.run(front.store.tokens_left("anonymous", QuotaLimits(tokens_per_minute=TPM)))
    assert left <= FLOOR
    error = responses[-1].json()["error"]
    assert error["code"] == "tokens_per_minute" and "min_context_tokens" in error["message"]


def test_an_upstream_prompt_over_max_input_tokens_is_fitted(front, examples):
    response = _chat(front, examples[0], "raw", max_tokens=4)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["ctxgate"]["fit"]["bound_by"] == "max_input_tokens"
    assert usage["prompt_tokens"] <= 600 < usage["ctxgate"]["original_prompt_tokens"]
