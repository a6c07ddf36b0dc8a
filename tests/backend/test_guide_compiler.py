"""Grammar compilation as hostile input: schema shapes capped before compiling, the deadline ends the
work (the worker process is killed and replaced), and one tenant's compiles never hold another's."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from ctxgate.backend.engine.guided import (
    MAX_OBJECT_PROPERTIES,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    GuideCompiler,
    GuideError,
    GuideSpec,
)
from ctxgate.backend.openai_api.errors import APIError
from ctxgate.backend.openai_api.request_params import guide_spec, tools_of
from ctxgate.backend.openai_api.schemas import ChatCompletionRequest
from tests.support.hostile_schemas import TRIVIAL, nested_arrays, slow_schema
from tests.support.waiting import eventually


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def _refusal(body: ChatCompletionRequest) -> APIError:
    started = time.perf_counter()
    with pytest.raises(APIError) as caught:
        guide_spec(body, tools_of(body))
    assert time.perf_counter() - started < 0.5  # refused by looking, not by compiling
    return caught.value


# -- caps ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": nested_arrays(600)},
                }
            },
            "response_format",
        ),
        ({"guided_json": nested_arrays(600)}, "guided_json"),
        ({"structured_outputs": {"json": nested_arrays(600)}}, "structured_outputs.json"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "ok", "parameters": TRIVIAL}},
                    {"type": "function", "function": {"name": "deep", "parameters": nested_arrays(600)}},
                ]
            },
            "tools[1].function.parameters",
        ),
    ],
)
def test_the_deep_schema_of_the_issue_is_refused_at_once_naming_its_field(fields, param):
    error = _refusal(_chat(**fields))
    assert error.status_code == 400 and error.param == param
    assert f"deeper than {MAX_SCHEMA_DEPTH} levels" in str(error)


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"enum": list(range(MAX_SCHEMA_NODES))}, f"more than {MAX_SCHEMA_NODES} JSON values"),
        (
            {"type": "object", "properties": {f"p{i}": {} for i in range(MAX_OBJECT_PROPERTIES + 1)}},
            f"declares {MAX_OBJECT_PROPERTIES + 1} properties in one object",
        ),
        (
            {"type": "object", "properties": {"a": slow_schema("a"), "b": slow_schema("b")}},
            "properties in all",
        ),
    ],
)
def test_schemas_over_the_size_caps_are_refused(schema, says):
    error = _refusal(_chat(guided_json=schema))
    assert error.param == "guided_json" and says in str(error)


def test_schemas_at_the_caps_are_accepted():
    assert GuideSpec.json_schema(nested_arrays(MAX_SCHEMA_DEPTH - 1), "guided_json").kind == "json_schema"
    assert GuideSpec.json_schema(slow_schema("x"), "guided_json").kind == "json_schema"
    # A forced call wraps the tool's parameters in four more levels; the tool's own cap holds.
    deep_tool = {
        "type": "function",
        "function": {"name": "f", "parameters": nested_arrays(MAX_SCHEMA_DEPTH - 1)},
    }
    body = _chat(tools=[deep_tool, {"type": "function", "function": {"name": "g"}}], tool_choice="required")
    assert guide_spec(body, tools_of(body)).param == "tool_choice"


# -- the deadline ends the work -------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has stopped working
    except FileNotFoundError:
        return False


def test_a_slow_schema_is_stopped_at_the_deadline_and_its_worker_killed(tokenizer):
    compiler = GuideCompiler(tokenizer, timeout_s=0.1, workers=1)
    try:
        asyncio.run(compiler.compile(GuideSpec.json_schema(TRIVIAL, "response_format")))  # the worker is up
        (before,) = compiler.worker_pids()
        started = time.perf_counter()
        with pytest.raises(GuideError, match=r"response_format did not compile within 0.1s") as caught:
            asyncio.run(compiler.compile(GuideSpec.json_schema(slow_schema("slow"), "response_format"), "b"))
        assert caught.value.status == 400 and time.perf_counter() - started < 2.0
        eventually(lambda: not _alive(before), timeout_s=10, message="the worker still runs the compile")
        after = eventually(compiler.worker_pids, timeout_s=30, message="no worker replaced the killed one")
        assert after != [before]
        other = GuideSpec.json_schema({"type": "array", "items": {"type": "integer"}}, "guided_json")
        assert (
            asyncio.run(compiler.compile(other, "c")).matcher().terminated is False
        )  # the new worker serves
    finally:
        compiler.close()


def test_a_cache_hit_compiles_nothing_and_a_broken_grammar_fails_once(tokenizer):
    compiler = GuideCompiler(tokenizer, workers=1)
    try:
        spec = GuideSpec.json_schema(TRIVIAL, "response_format")
        first = asyncio.run(compiler.compile(spec, "a"))
        compiler.close()  # no workers left: only the cache can answer now
        assert asyncio.run(compiler.compile(spec, "b")) is first
    finally:
        compiler.close()
    compiler = GuideCompiler(tokenizer, workers=1)
    try:
        broken = GuideSpec("grammar", "root ::= (", "guided_grammar")
        with pytest.raises(GuideError, match="guided_grammar could not be compiled"):
            asyncio.run(compiler.compile(broken, "a"))
        compiler.close()
        with pytest.raises(GuideError, match="guided_grammar could not be compiled"):
            asyncio.run(compiler.compile(broken, "a"))  # remembered, not recompiled
    finally:
        compiler.close()


# -- fairness -------------------------------------------------------------------------------------


def test_a_flooding_tenant_does_not_delay_another_tenants_trivial_schema(tokenizer):
    compiler = GuideCompiler(tokenizer, workers=2, max_queued_per_tenant=4)

    async def flood_then_trivial() -> tuple[float, list[Any]]:
        await compiler.compile(GuideSpec.json_schema({"type": "integer"}, "guided_json"), "warm")
        flood = [
            asyncio.create_task(
                compiler.compile(GuideSpec.json_schema(slow_schema(f"n{i}_"), "guided_json"), "b")
            )
            for i in range(6)
        ]
        await asyncio.sleep(0.2)
        started = time.perf_counter()
        await compiler.compile(GuideSpec.json_schema(TRIVIAL, "response_format"), "c")
        took = time.perf_counter() - started
        for task in flood[1:]:
            task.cancel()  # queued ones are dropped, never compiled
        return took, await asyncio.gather(*flood, return_exceptions=True)

    try:
        took, flood = asyncio.run(flood_then_trivial())
        assert took < 1.0, f"tenant c waited {took:.2f} s behind tenant b's compiles"
        # b's first compile ran (or hit its deadline); of the five others, four queued and were
        # cancelled above, and at least one found b's queue full.
        refused = [r for r in flood[1:] if isinstance(r, GuideError)]
        assert refused and all(r.status == 429 for r in refused)
    finally:
        compiler.close()
