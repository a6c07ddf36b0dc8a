"""Tool calls as plain prompt text, for a chat template that knows nothing of tools.

The model writes a call between `<tool_call>` tags (Hermes / Qwen convention); the OpenAI
protocol layer (openai_api/tools.py) reads calls back out with the same markers.
"""

from __future__ import annotations

import json
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def fold_tool_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Messages for a chat template that knows nothing of tools: the tools and the call format go
    into the system message, an assistant's calls become `<tool_call>` text, a tool result a turn of
    role "tool"."""
    folded = []
    for message in messages:
        content = message.get("content") or ""
        calls = message.get("tool_calls")
        calls = [call for call in calls if isinstance(call, dict)] if isinstance(calls, list) else []
        if calls:
            content = (content + "\n" if content else "") + "\n".join(_tagged(call) for call in calls)
        folded.append({"role": message["role"], "content": content})
    if tools:
        preamble = (
            "You may call functions. The functions, as JSON schemas:\n"
            + "\n".join(json.dumps(tool.get("function", tool), ensure_ascii=False) for tool in tools)
            + f'\nTo call one, answer with {TOOL_CALL_OPEN}{{"name": <name>, "arguments": <object>}}'
            f"{TOOL_CALL_CLOSE}."
        )
        if folded and folded[0]["role"] == "system":
            folded[0] = {"role": "system", "content": folded[0]["content"] + "\n\n" + preamble}
        else:
            folded.insert(0, {"role": "system", "content": preamble})
    return folded


def _tagged(call: dict[str, Any]) -> str:
    function = call.get("function")
    function = function if isinstance(function, dict) else {}
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass  # kept as the string the client sent
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"
