"""JSON schemas a hostile tenant sends: the issue's deep one, and ones slow to compile yet legal."""

from __future__ import annotations

from typing import Any

TRIVIAL = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def nested_arrays(depth: int) -> dict[str, Any]:
    """The issue's schema: arrays in arrays (600 deep compiled for over 5 s)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def slow_schema(nonce: str) -> dict[str, Any]:
    """Under every cap, yet slow to compile (about 0.3-0.9 s): 7 objects of 128 optional properties
    (xgrammar's cost grows with the square of an object's optional properties). `nonce` keeps it
    out of the cache."""
    inner = {"type": "object", "properties": {f"p{i}": {} for i in range(128)}}
    return {"type": "object", "properties": {f"{nonce}{j}": inner for j in range(7)}}
