"""Tool definitions over a policy's `tools.max_tokens`, shortened to fit (`fit.tools: compress`).

Descriptions are the part of a tool definition a call can do without: the function's name and its
parameters' schema are what the model must produce and what guided decoding compiles. So the
shortening drops them in two steps, the parameters' descriptions first, then the functions' own,
and never touches anything else; a definition still over the cap is refused (413) as under
`reject`. The client's structures are copied, never changed, and walked without recursion (their
nesting is the client's to choose).
"""

from __future__ import annotations

from typing import Any

# Shortening steps: 1 drops the parameters' descriptions, 2 the functions' descriptions as well.
SHORTENING_STEPS = (1, 2)


def shortened(tools: list[Any], step: int) -> list[Any]:
    """`tools` with the descriptions of `step` dropped (see `SHORTENING_STEPS`)."""
    result: list[Any] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            result.append(tool)
            continue
        copy = {key: value for key, value in function.items() if not (step >= 2 and key == "description")}
        if "parameters" in copy:
            copy["parameters"] = without_descriptions(copy["parameters"])
        result.append({**tool, "function": copy})
    return result


def without_descriptions(schema: Any) -> Any:
    """A copy of a JSON schema without its `description` texts (a property named "description" has a
    schema, not a text, for its value: it stays)."""
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(schema, root, 0)]
    while stack:
        value, parent, key = stack.pop()
        if isinstance(value, dict):
            copy: dict[str, Any] = {}
            parent[key] = copy
            for name, item in value.items():
                if name == "description" and isinstance(item, str):
                    continue
                copy[name] = None
                stack.append((item, copy, name))
        elif isinstance(value, list):
            items: list[Any] = [None] * len(value)
            parent[key] = items
            stack.extend((item, items, index) for index, item in enumerate(value))
        else:
            parent[key] = value
    return root[0]
