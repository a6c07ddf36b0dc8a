"""Tool definitions shortened to fit `tools.max_tokens` (gateway/tools_fit.py): descriptions go, the
parameters' first, then the functions'; names and schemas stay; the client's structures are copied."""

from __future__ import annotations

import copy

from ctxgate.gateway.tools_fit import shortened, without_descriptions

TOOL = {
    "type": "function",
    "function": {
        "name": "file_issue",
        "description": "File an issue in the tracker.",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string", "description": "a one-line summary"},
                # A parameter that happens to be called "description": its schema stays.
                "description": {"type": "string", "description": "the issue's body"},
                "labels": {"type": "array", "items": {"type": "string", "description": "a label"}},
            },
            "required": ["title"],
        },
    },
}


def test_step_one_drops_the_parameters_descriptions_only():
    before = copy.deepcopy(TOOL)
    (tool,) = shortened([TOOL], 1)
    assert TOOL == before  # the client's structure is not changed
    function = tool["function"]
    assert function["name"] == "file_issue" and function["description"] == "File an issue in the tracker."
    properties = function["parameters"]["properties"]
    assert properties == {
        "title": {"type": "string"},
        "description": {"type": "string"},
        "labels": {"type": "array", "items": {"type": "string"}},
    }
    assert function["parameters"]["required"] == ["title"]


def test_step_two_drops_the_functions_description_too():
    (tool,) = shortened([TOOL], 2)
    assert "description" not in tool["function"] and tool["function"]["name"] == "file_issue"


def test_other_shapes_pass_through_untouched():
    odd = [{"type": "retrieval"}, "not-an-object", {"function": "not-an-object"}]
    assert shortened(odd, 2) == odd


def test_a_deeply_nested_schema_is_walked_without_recursion():
    schema: dict = {"type": "string", "description": "leaf"}
    for _ in range(20_000):
        schema = {"type": "object", "description": "level", "properties": {"x": schema}}
    stripped = without_descriptions(schema)
    depth = 0
    while "properties" in stripped:
        assert "description" not in stripped
        stripped = stripped["properties"]["x"]
        depth += 1
    assert depth == 20_000 and stripped == {"type": "string"}
