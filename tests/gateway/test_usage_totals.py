"""`usage.ctxgate`'s totals through a real server and the real model: what was saved and how long it
took, at a glance, consistent with the per-stage figures; `cost` null without prices;
`message_context` only when the passages came from the messages; every key read back by the client."""

from __future__ import annotations

import httpx
import pytest

from ctxgate.client import CtxgateUsage
from ctxgate.gateway.app import create_app
from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import ServerThread, write_policy

UNPRICED = "name: unpriced\nmax_input_tokens: 220\nreserve_output_tokens: 4\ndocuments: {max_tokens: 120, from_messages: true}\n"
PRICED = UNPRICED.replace("unpriced", "priced") + "cost: {prompt_per_1k: 0.5, completion_per_1k: 1.5}\n"
TOWNS = ["Arlen", "Brisk", "Cobb", "Dune", "Elm", "Fenn", "Gale", "Hollow"]
PASSAGES = [
    f"The town of {town} lies on the river {town[::-1]} and was founded in {1700 + 13 * i}. Its mill "
    f"grinds barley for {i + 2} villages and its bridge has {i + 3} arches of grey stone."
    for i, town in enumerate(TOWNS)
]
QUESTION = "When was the town of Cobb founded?"


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    policy_dir = tmp_path_factory.mktemp("usage")
    write_policy(policy_dir, "unpriced", UNPRICED)
    write_policy(policy_dir, "priced", PRICED)
    app = create_app(GatewaySettings(policy_dir=policy_dir, default_policy="unpriced"), engine=engine)
    with ServerThread(app) as running:
        running.app = app
        yield running


def _chat(server, messages: list[dict], policy: str = "unpriced", documents: list[str] | None = None) -> dict:
    extension = {"policy": policy} | (
        {"documents": [{"text": text} for text in documents]} if documents else {}
    )
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": messages,
        "max_tokens": 2,
        "temperature": 0,
        "ctxgate": extension,
    }
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["ctxgate"]


def test_totals_add_up_and_the_embedding_has_its_own_key(server):
    question = [{"role": "user", "content": QUESTION}]
    _chat(server, question, documents=PASSAGES)  # the embedding model's first use, and a prefill measured
    estimator = server.app.state.gateway.prompts.pipeline.cost_estimator
    ms_per_token = estimator.ms_per_token  # what the next request's cost check reads
    ctx = _chat(server, question, documents=[*PASSAGES[1:], PASSAGES[0]])
    original, sent = ctx["original_prompt_tokens"], ctx["prompt_tokens"]
    assert sent < original
    assert ctx["saved_tokens_total"] == original - sent == sum(ctx["saved_tokens"].values())
    assert ctx["reduction"] == round(original / sent, 2)
    assert ctx["estimated_prefill_ms_saved"] == round((original - sent) * ms_per_token, 1) > 0
    assert "embedding" in ctx["compression_ms"] and "embedding" not in ctx["saved_tokens"]
    assert ctx["compression_ms_total"] == pytest.approx(sum(ctx["compression_ms"].values()), abs=0.01)
    assert ctx["cost"] is None and ctx["cost_detail"] is None  # no prices: not "free"
    assert "message_context" not in ctx  # the documents came in the extension
    assert CtxgateUsage.from_dict(ctx).to_dict() == ctx


def test_priced_policy_and_passages_in_the_messages(server):
    context = "\n\n".join(PASSAGES)
    messages = [
        {"role": "system", "content": f"Use the following pieces of retrieved context.\n\n{context}"},
        {"role": "user", "content": QUESTION},
    ]
    ctx = _chat(server, messages, policy="priced")
    assert ctx["message_context"]["passages_found"] == len(PASSAGES)
    assert ctx["cost"] > 0 and ctx["cost_detail"]["total"] == ctx["cost"]
    assert ctx["saved_tokens_total"] == ctx["original_prompt_tokens"] - ctx["prompt_tokens"] > 0
    assert CtxgateUsage.from_dict(ctx).to_dict() == ctx


def test_the_compress_report_carries_the_same_totals(server):
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": QUESTION}],
        "ctxgate": {"documents": [{"text": text} for text in PASSAGES]},
    }
    report = httpx.post(f"{server.url}/v1/ctxgate/compress", json=body, timeout=120).json()["report"]
    assert report["saved_tokens_total"] == report["original_prompt_tokens"] - report["prompt_tokens"]
    assert report["reduction"] == round(report["original_prompt_tokens"] / report["prompt_tokens"], 2)
    assert "message_context" not in report and "embedding" in report["compression_ms"]
