"""One field described for the reference: its type, default, constraints and the comments the
code gives it, and the Markdown table the rows become."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


def field_comments(cls: type) -> dict[str, str]:
    """The comments written above (or beside) each annotated attribute of a class, by name.

    Dataclasses and many pydantic fields carry their help as comments; this reads them from the
    source, so the reference says what the code's reader is told.
    """
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    source = textwrap.dedent("".join(lines))
    lines = source.splitlines()
    comments: dict[str, str] = {}
    class_node = ast.parse(source).body[0]
    for node in getattr(class_node, "body", []):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        index = node.lineno - 2
        while index >= 0 and lines[index].strip().startswith("#"):
            above.insert(0, lines[index].strip().lstrip("#").strip())
            index -= 1
        beside = _trailing_comment(lines[node.end_lineno - 1])
        text = " ".join(part for part in (*above, beside) if part)
        if text:
            comments[node.target.id] = text
    return comments


def _trailing_comment(line: str) -> str:
    # A '#' outside quotes starts the comment (enough for the one-line field declarations here).
    quote = None
    for position, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#":
            return line[position + 1 :].strip()
    return ""


def type_text(annotation: Any) -> str:
    """A reader's name for a type: `int or null`, `one of "a", "b"`, `list of str`."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(arg) for arg in args)
    if origin is Literal:
        return "one of " + ", ".join(f'"{arg}"' if isinstance(arg, str) else repr(arg) for arg in args)
    if origin is list:
        return f"list of {type_text(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {type_text(args[0])} to {type_text(args[1])}" if args else "map"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is datetime:
        return "date-time"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


_CONSTRAINT_ATTRS = (
    ("ge", ">="),
    ("gt", ">"),
    ("le", "<="),
    ("lt", "<"),
    ("min_length", "length >="),
    ("max_length", "length <="),
    ("pattern", "matches"),
    ("multiple_of", "multiple of"),
)


def constraints_text(metadata: list[Any]) -> str:
    parts = []
    for item in metadata:
        for attr, word in _CONSTRAINT_ATTRS:
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{word} {value}")
    return ", ".join(parts)


def default_text(value: Any) -> str:
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def factory_default(factory: Callable[[], Any] | None) -> str:
    # Only empty containers are evaluated: other factories read the environment or the machine,
    # which would put the build host's values (or secrets) into the docs.
    if factory in (list, dict):
        return repr(factory())
    return "set at start-up (see description)"


@dataclasses.dataclass
class Row:
    name: str
    type: str
    default: str
    constraints: str = ""
    description: str = ""
    extra: str = ""  # a page-specific column (the CLI flag of a config key)


def cell(text: str, code: bool = False) -> str:
    if not text:
        return ""
    if code:
        return f"`{text}`"
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: list[Row], extra_header: str | None = None) -> str:
    header = ["Field", "Type", "Default", "Constraints", "Description"]
    if extra_header:
        header.insert(3, extra_header)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        cells = [cell(row.name, True), cell(row.type), cell(row.default, True)]
        if extra_header:
            cells.append(cell(row.extra, True))
        cells += [cell(row.constraints, True), cell(row.description)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
