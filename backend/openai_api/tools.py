"""Tool calling on the built-in engine: the request's `tools` / `tool_choice`, the grammar that forces
a call, and the reading of calls out of the generated text.

The model writes a call as `{"name": ..., "arguments": {...}}`: under `tool_choice` "required" or a
named function the whole output is such an object, constrained by a JSON schema built from the
functions' parameter schemas (so the arguments always parse against them); under "auto" the model
may write calls between `<tool_call>` tags (Hermes / Qwen convention), which are read out afterwards.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from ctxgate.backend.engine.guided import GuideError, GuideSpec, check_schema_shape
from ctxgate.backend.model.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from ctxgate.backend.openai_api.errors import APIError

MAX_TOOLS = 64
_TAGGED_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(\{.*?\})\s*" + re.escape(TOOL_CALL_CLOSE), re.S)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]
    # Rendered with the schema: models choose among functions by what they are for.
    description: str | None = None


@dataclass(frozen=True)
class ToolUse:
    """The request's tools and how the answer may use them."""

    functions: tuple[Function, ...]
    mode: Literal["auto", "required", "named"]
    forced: str | None = None  # the function a named tool_choice calls

    def guide(self) -> GuideSpec | None:
        """The grammar of a forced call; None under "auto"."""
        if self.mode == "auto":
            return None
        functions = [f for f in self.functions if self.mode == "required" or f.name == self.forced]
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        # Each tool's parameters passed the depth cap alone; the wrapping above adds four levels.
        return GuideSpec.json_schema(schema, "tool_choice", wrapper_depth=4)

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's shape). Client text: the gateway
        neutralises it before rendering (ctxgate.gateway.sanitize.Neutraliser.value)."""
        return [
            {
                "type": "function",
                "function": {"name": f.name, "parameters": f.parameters}
                | ({"description": f.description} if f.description else {}),
            }
            for f in self.functions
        ]

    def read_calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content left, tool calls) read from a choice's text."""
        if self.mode != "auto":
            call = _call_from(text, self.functions)
            return (None, [call]) if call else (text, [])
        calls = [
            call
            for match in _TAGGED_CALL.finditer(text)
            if (call := _call_from(match.group(1), self.functions))
        ]
        if not calls:
            return text, []
        content = _TAGGED_CALL.sub("", text).strip()
        return content or None, calls


def _call_from(text: str, functions: tuple[Function, ...]) -> dict[str, Any] | None:
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not any(f.name == parsed.get("name") for f in functions):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": parsed["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def tool_use(tools: Any, tool_choice: Any) -> ToolUse | None:
    """The request's tool use, or None when it asks for none (no tools, or tool_choice "none")."""
    if tool_choice == "none" or not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(
                400,
                "tool_choice names a tool but no tools are given",
                param="tool_choice",
                code="invalid_value",
            )
        return None
    functions = _functions(tools)
    if tool_choice in (None, "auto"):
        return ToolUse(functions, "auto")
    if tool_choice == "required":
        return ToolUse(functions, "required")
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str) or not any(f.name == name for f in functions):
        raise APIError(
            400,
            'tool_choice must be none, auto, required or {"type": "function", "function": '
            '{"name": <one of the tools>}}',
            param="tool_choice",
            code="invalid_value",
        )
    return ToolUse(functions, "named", name)


def _functions(tools: Any) -> tuple[Function, ...]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise APIError(
            400, f"tools must be a list of at most {MAX_TOOLS} functions", param="tools", code="invalid_value"
        )
    functions = []
    for index, tool in enumerate(tools):
        function = (
            tool.get("function")
            if isinstance(tool, dict) and tool.get("type", "function") == "function"
            else None
        )
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(
                400,
                f'tools[{index}] must be {{"type": "function", "function": {{"name": ...}}}} '
                "with a name of letters, digits, _ . - (at most 64)",
                param=f"tools[{index}]",
                code="invalid_value",
            )
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise APIError(
                400,
                f"tools[{index}].function.parameters must be a JSON schema object",
                param=f"tools[{index}]",
                code="invalid_value",
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise APIError(
                400,
                f"tools[{index}].function.description must be a string",
                param=f"tools[{index}]",
                code="invalid_value",
            )
        try:  # checked for every tool (its schema is rendered into the prompt), forced or not
            check_schema_shape(parameters, f"tools[{index}].function.parameters")
        except GuideError as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
        functions.append(Function(name, parameters, description))
    return tuple(functions)
