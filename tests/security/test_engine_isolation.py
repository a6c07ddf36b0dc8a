"""One tenant's sampling fields never fail another tenant's generation (issue 48, item 1).

Every tenant's sequences share the engine's batched step. Before, `stop_token_ids: [1000000000]`
with `min_tokens`, `top_k: 2**63` or a `guided_choice` shorter than `min_tokens` made that step raise,
and the engine then failed every running request with a 500 mid-stream. Here the sampling and guide
fields of one request are fuzzed beside a victim on the same real engine, and the issue's three
requests are replayed over HTTP against a real gateway while another stream runs.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ctxgate.backend.engine.api import EngineError, GenerationRequest, SamplingParams
from ctxgate.backend.engine.guided import GuideSpec, compiler_for
from ctxgate.gateway.app import create_app
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.conftest import engine  # noqa: F401 (the gateway's real engine)
from tests.support.servers import ServerThread, write_policy

PROMPT = [1, 504, 3458, 282, 4649, 314]
VICTIM = SamplingParams(max_tokens=8, temperature=0)
GUIDES = {
    None: None,
    "choice-a": GuideSpec.choice(["a"], "guided_choice"),
    "choice-yes-no": GuideSpec.choice(["yes", "no"], "guided_choice"),
    "regex-digits": GuideSpec("regex", "[0-9]{1,3}", "guided_regex"),
    "json-object": GuideSpec("json_object", "", "response_format"),
}


@pytest.fixture(scope="module")
def llm(model_dir):
    """A float32 engine with a short context: a fuzzed max_tokens is clamped to a few dozen tokens."""
    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.backend.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            num_threads=1,
            kv_cache_memory_mb=16,
            max_model_len=20,
            max_num_seqs=4,
            device="cpu",  # a fuzzed value that slipped past admission must not end a CUDA context
        )
    )


@pytest.fixture(scope="module")
def guides(llm) -> dict[str | None, object]:
    compiler = compiler_for(llm.tokenizer)
    return {name: spec and compiler.compile_now(spec) for name, spec in GUIDES.items()}


@pytest.fixture(scope="module")
def victim_alone(llm) -> list[int]:
    return llm.generate([PROMPT], VICTIM)[0]


huge = st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63) - 1])
ints = st.integers(-3, 60) | huge
floats = st.floats(allow_nan=True, allow_infinity=True) | st.floats(-3, 3) | st.sampled_from([0.0, 1e-6, 1.0])
token_ids = st.integers(-2, 49_151) | huge | st.just(1_000_000_000)
fuzzed_fields = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(-1, 6) | huge,
        "min_tokens": ints,
        "temperature": floats,
        "top_k": ints,
        "top_p": floats,
        "min_p": floats,
        "seed": ints,
        "n": st.integers(-1, 3) | st.just(5),
        "stop_token_ids": st.lists(token_ids, max_size=4),
        "ignore_eos": st.booleans(),
        "presence_penalty": floats,
        "frequency_penalty": floats,
        "repetition_penalty": floats,
        "logit_bias": st.dictionaries(token_ids, floats, max_size=3),
        "logprobs": st.none() | st.integers(-2, 25),
        "guide": st.sampled_from(list(GUIDES)),
    },
)


@settings(max_examples=20, deadline=None)
@example({"stop_token_ids": [1_000_000_000], "min_tokens": 5})
@example({"top_k": 2**63})
@example({"guide": "choice-a", "min_tokens": 12, "max_tokens": 30})
@example({"guide": "choice-a", "min_tokens": 12, "max_tokens": 30, "temperature": 0.0})
@given(fields=fuzzed_fields)
def test_fuzzed_sampling_fields_never_fail_the_victim(llm, guides, victim_alone, fields):
    params = SamplingParams(**{**fields, "guide": guides[fields.get("guide")]})
    llm.add_request(GenerationRequest("victim", PROMPT, VICTIM))
    try:
        llm.add_request(GenerationRequest("fuzzed", PROMPT, params))
    except EngineError as refused:  # refused at admission: a 4xx naming the field
        assert 400 <= refused.status_code < 500 and refused.param, (fields, refused)
    tokens: dict[str, list[int]] = {"victim": [], "fuzzed": []}
    failures: dict[str, EngineError] = {}
    while llm.has_unfinished_requests():
        for delta in llm.step():
            tokens[delta.request_id].extend(delta.token_ids)
        failures.update(llm.take_failures())
    assert "victim" not in failures, (fields, failures)
    assert tokens["victim"] == victim_alone, fields
    assert all(error.status_code < 500 for error in failures.values()), (fields, failures)
    llm.scheduler.check_invariants()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


# ---- the issue's three requests, over HTTP, while another tenant streams -------------------------
ATTACKS = {
    # Refused at admission: the id is past the vocabulary.
    "stop_token_ids": ({"stop_token_ids": [1_000_000_000], "min_tokens": 5}, 400),
    # Keeps every token, as top_k = 0 does: served.
    "top_k": ({"top_k": 2**63}, 200),
    # The grammar can only end after "a": its end wins over min_tokens.
    "guided_choice": ({"guided_choice": ["a"], "min_tokens": 12}, 200),
}
VICTIM_TOKENS = 96


@pytest.fixture(scope="module")
def gateway(engine, tmp_path_factory):  # noqa: F811 (the engine fixture)
    policy_dir = tmp_path_factory.mktemp("isolation")
    write_policy(
        policy_dir,
        "iso",
        "name: iso\nmax_input_tokens: 256\nreserve_output_tokens: 128\n"
        "documents: {max_tokens: 64}\nrerank: {enabled: false}\ndedup: {near_duplicate_cosine: null}\n",
    )
    app = create_app(GatewaySettings(policy_dir=policy_dir, default_policy="iso"), engine=engine)
    with ServerThread(app) as running:
        yield running.url


def _chat(content: str, **fields) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}], **fields}


def test_the_issues_requests_do_not_fail_another_tenants_stream(gateway):
    victim_body = _chat(
        "Tell me a long story about a lighthouse keeper.",
        max_tokens=VICTIM_TOKENS,
        ignore_eos=True,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    events: list[dict] = []
    streaming = threading.Event()
    ended_at: list[float] = []

    def victim() -> None:
        with httpx.stream(
            "POST", f"{gateway}/v1/chat/completions", json=victim_body, timeout=120
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line.removeprefix("data: ")))
                    streaming.set()
        ended_at.append(time.monotonic())

    thread = threading.Thread(target=victim)
    thread.start()
    assert streaming.wait(60), "the victim's stream did not start"
    answers: dict[str, httpx.Response] = {}

    def attack(name: str) -> None:
        fields, _ = ATTACKS[name]
        answers[name] = httpx.post(
            f"{gateway}/v1/chat/completions", timeout=120, json=_chat("Pick one.", max_tokens=16, **fields)
        )

    attackers = [threading.Thread(target=attack, args=(name,)) for name in ATTACKS]
    for attacker in attackers:
        attacker.start()
    for attacker in attackers:
        attacker.join(120)
    attacked_at = time.monotonic()
    thread.join(120)

    assert not [event for event in events if "error" in event], events
    finish = [
        choice["finish_reason"]
        for event in events
        for choice in event.get("choices", [])
        if choice.get("finish_reason")
    ]
    assert finish == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == VICTIM_TOKENS
    assert ended_at and attacked_at < ended_at[0], "the attacks did not overlap the victim's stream"
    for name, (_, status) in ATTACKS.items():
        assert answers[name].status_code == status, (name, answers[name].text)
    assert answers["stop_token_ids"].json()["error"]["param"] == "stop_token_ids"
    assert answers["guided_choice"].json()["choices"][0]["message"]["content"] == "a"
    assert answers["top_k"].json()["usage"]["completion_tokens"] >= 1
