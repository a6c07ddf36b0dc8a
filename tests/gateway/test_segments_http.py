"""`usage.ctxgate.segments` through HTTP, built-in engine and upstream mode: before and after per
segment (system, history, documents, tools, question, output), adding up exactly to
original_prompt_tokens, prompt_tokens and completion_tokens in every request shape; the per-segment
cost and the `segment` label of the metrics; a policy's cap on the tools segment."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from ctxgate.gateway.app import create_app
from ctxgate.gateway.settings import GatewaySettings
from ctxgate.gateway.tools_fit import shortened
from tests.support.servers import ServerThread, serve_engine, write_policy
from tests.town_facts import TOWN_FACTS, TOWN_QUESTION

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "Answer from the documents. Reply with a short phrase."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a town up in the gazetteer and return its population and river.",
            "parameters": {"type": "object", "properties": {"town": {"type": "string"}}},
        },
    }
]
CHEAP = "rerank: {method: bm25, top_k: 2}\ndedup: {near_duplicate_cosine: null}\n"
PRICES = "cost: {prompt_per_1k: 0.5, completion_per_1k: 1.5}\n"
SEGMENT_POLICY = (
    f"max_input_tokens: 1024\ndocuments: {{max_tokens: 120}}\n{CHEAP}{PRICES}"
    "history: {max_tokens: 60, strategy: truncate, keep_last_turns: 1}\n"
)


def _documents() -> list[dict[str, str]]:
    return [{"text": text, "title": name} for name, text in TOWN_FACTS[:6]]


def _history() -> list[dict[str, str]]:
    turns = []
    for i in range(6):
        turns.append({"role": "user", "content": f"Tell me about town number {i} and its rivers, please."})
        turns.append({"role": "assistant", "content": f"Town {i} lies on a long and winding river. " * 4})
    return turns


# Each request shape: (extra body fields, policy, messages, what its segments must show).
SHAPES: dict[str, tuple[dict[str, Any], str, list[dict[str, str]], Any]] = {
    "extension-documents": (
        {"ctxgate": {"policy": "seg", "documents": _documents()}},
        "seg",
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TOWN_QUESTION}],
        lambda s: s["documents"]["before"] > s["documents"]["after"] > 0 and s["history"]["before"] == 0,
    ),
    "history": (
        {"ctxgate": {"policy": "seg", "documents": _documents()}},
        "seg",
        [{"role": "system", "content": SYSTEM}, *_history(), {"role": "user", "content": TOWN_QUESTION}],
        lambda s: s["history"]["before"] > s["history"]["after"] > 0,
    ),
    "documents-in-messages": (
        {"ctxgate": {"policy": "seg-msgs"}},
        "seg-msgs",
        [
            {
                "role": "system",
                "content": "Use the following pieces of retrieved context to answer the question.\n\n"
                + "\n\n".join(text for _, text in TOWN_FACTS[:6]),
            },
            {"role": "user", "content": TOWN_QUESTION},
        ],
        lambda s: (
            s["documents"]["before"] > s["documents"]["after"] > 0
            and s["system"]["before"] == s["system"]["after"]
        ),
    ),
    "tools": (
        {"tools": TOOLS, "ctxgate": {"policy": "seg"}},
        "seg",
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TOWN_QUESTION}],
        # Upstream mode: the upstream's own count (its template's framing of the tools included)
        # is the after side, so the tools can count more there than the gateway counted before.
        lambda s: s["tools"]["after"] >= s["tools"]["before"] > 20 and s["documents"]["before"] == 0,
    ),
}


def _tools_caps(tokenizer) -> dict[str, tuple[int, int]]:
    """Per mode, the tool definitions' tokens as the gateway counts them, whole and shortened
    (descriptions dropped): rendered by the template (built-in) or as forwarded JSON (upstream)."""
    messages = [{"role": "user", "content": TOWN_QUESTION}]

    def rendered(tools) -> int:
        return tokenizer.count(tokenizer.render_chat(messages, tools=tools)) - tokenizer.count_chat(messages)

    def forwarded(tools) -> int:
        return tokenizer.count(json.dumps({"tools": tools}, ensure_ascii=False))

    short = shortened(TOOLS, 2)
    return {"builtin": (rendered(TOOLS), rendered(short)), "upstream": (forwarded(TOOLS), forwarded(short))}


@pytest.fixture(scope="module")
def tools_caps(tokenizer) -> dict[str, tuple[int, int]]:
    return _tools_caps(tokenizer)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, tools_caps):
    directory = tmp_path_factory.mktemp("segments")
    for mode, (whole, short) in tools_caps.items():
        # A cap the shortened definitions fit and the whole ones do not.
        write_policy(
            directory,
            f"seg-tools-fit-{mode}",
            f"name: seg-tools-fit-{mode}\n{SEGMENT_POLICY}tools: {{max_tokens: {(whole + short) // 2}}}\n"
            "fit: {tools: compress}\n",
        )
    write_policy(directory, "seg", f"name: seg\n{SEGMENT_POLICY}")
    write_policy(
        directory,
        "seg-msgs",
        f"name: seg-msgs\n{SEGMENT_POLICY.replace('max_tokens: 120}', 'max_tokens: 120, from_messages: true}')}",
    )
    write_policy(
        directory, "seg-tools-cap", f"name: seg-tools-cap\n{SEGMENT_POLICY}tools: {{max_tokens: 20}}\n"
    )
    return directory


@pytest.fixture(scope="module")
def builtin(engine, policy_dir):
    with ServerThread(create_app(GatewaySettings(policy_dir=policy_dir), engine=engine)) as running:
        yield running


@pytest.fixture(scope="module")
def upstream(engine, policy_dir, model_dir):
    """The gateway in front of a real upstream: the engine's own OpenAI server."""
    with serve_engine(engine, manage_engine=False) as url:
        settings = GatewaySettings(
            policy_dir=policy_dir, upstreams=[f"{url}/v1"], served_model_name=MODEL, tokenizer=str(model_dir)
        )
        with ServerThread(create_app(settings)) as running:
            yield running


def _chat(server, messages, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0} | fields
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)


def _check_sums(usage: dict[str, Any]) -> dict[str, dict[str, int]]:
    segments = usage["ctxgate"]["segments"]
    assert list(segments) == ["system", "history", "documents", "tools", "question", "output"]
    prompt = [name for name in segments if name != "output"]
    assert sum(segments[name]["after"] for name in prompt) == usage["prompt_tokens"]
    assert sum(segments[name]["before"] for name in prompt) == usage["ctxgate"]["original_prompt_tokens"]
    assert segments["output"] == {"before": usage["completion_tokens"], "after": usage["completion_tokens"]}
    assert segments["question"]["after"] > 0 and segments["system"]["after"] > 0
    return segments


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", ["builtin", "upstream"])
def test_segments_add_up_exactly_in_every_shape(request, mode, shape):
    server = request.getfixturevalue(mode)
    fields, _, messages, shows = SHAPES[shape]
    response = _chat(server, messages, **fields)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    segments = _check_sums(usage)
    assert shows(segments), segments
    # Each segment's spend at the policy's prices: prompt segments at the prompt price, output at
    # the completion price; together the request's cost.
    detail = usage["ctxgate"]["cost_detail"]
    assert detail["segments"]["output"] == pytest.approx(usage["completion_tokens"] / 1000 * 1.5)
    assert detail["segments"]["documents"] == pytest.approx(segments["documents"]["after"] / 1000 * 0.5)
    assert sum(detail["segments"].values()) == pytest.approx(detail["total"], abs=1e-6)


def test_the_metrics_carry_the_segment_label(builtin):
    fields, _, messages, _ = SHAPES["extension-documents"]
    usage = _chat(builtin, messages, **fields).json()["usage"]
    segments = usage["ctxgate"]["segments"]
    text = httpx.get(f"{builtin.url}/metrics").text

    def value(metric: str, segment: str) -> float:
        for line in text.splitlines():
            if line.startswith(f"ctxgate:{metric}_total{{") and f'segment="{segment}"' in line:
                if 'tenant="anonymous"' in line and 'policy="seg"' in line:
                    return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no {metric} line for segment {segment}")

    for segment in segments:
        assert value("segment_tokens_sent", segment) >= segments[segment]["after"]
        assert value("segment_tokens_original", segment) >= segments[segment]["before"]
    assert value("segment_tokens_original", "documents") > value("segment_tokens_sent", "documents")


@pytest.mark.parametrize("mode", ["builtin", "upstream"])
def test_tool_definitions_over_the_cap_are_refused_naming_the_segment(request, mode):
    server = request.getfixturevalue(mode)
    messages = [{"role": "user", "content": TOWN_QUESTION}]
    response = _chat(server, messages, tools=TOOLS, ctxgate={"policy": "seg-tools-cap"})
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and error["code"] == "tools_too_long"
    assert "tools.max_tokens" in error["message"] and "allows 20" in error["message"]
    # Without tools the same policy serves the request.
    assert _chat(server, messages, ctxgate={"policy": "seg-tools-cap"}).status_code == 200


@pytest.mark.parametrize("mode", ["builtin", "upstream"])
def test_tool_definitions_over_the_cap_are_shortened_under_fit_tools_compress(request, mode, tools_caps):
    server = request.getfixturevalue(mode)
    whole, short = tools_caps[mode]
    cap = (whole + short) // 2
    messages = [{"role": "user", "content": TOWN_QUESTION}]
    response = _chat(server, messages, tools=TOOLS, ctxgate={"policy": f"seg-tools-fit-{mode}"})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    segments = _check_sums(usage)
    # Within a token of the test's own count (the gateway renders the neutralised definitions).
    assert abs(segments["tools"]["before"] - whole) <= 1 and segments["tools"]["before"] > cap
    if mode == "builtin":  # upstream: the after side is the upstream's own count
        assert abs(segments["tools"]["after"] - short) <= 1 and segments["tools"]["after"] <= cap
