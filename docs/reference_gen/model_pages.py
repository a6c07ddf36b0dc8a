"""Reference tables of pydantic models (a section per nested model) and of settings dataclasses."""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel

from reference_gen.fields import (
    Row,
    constraints_text,
    default_text,
    factory_default,
    field_comments,
    table,
    type_text,
)


def _nested_model(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """The model a field holds (directly, in a list, a map or an Optional) and the path suffix."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args:
        inner = _nested_model(args[0])
        return (inner[0], "[]" + inner[1]) if inner else None
    if origin is dict and len(args) == 2:
        inner = _nested_model(args[1])
        return (inner[0], ".<name>" + inner[1]) if inner else None
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            inner = _nested_model(arg)
            if inner:
                return inner
    return None


def model_rows(model: type[BaseModel], prefix: str = "") -> list[Row]:
    comments = field_comments(model)
    rows = []
    for name, info in model.model_fields.items():
        if info.default_factory is not None:
            default = factory_default(info.default_factory)
        else:
            default = default_text(info.default)
        rows.append(
            Row(
                name=prefix + name,
                type=type_text(info.annotation),
                default=default,
                constraints=constraints_text(info.metadata),
                description=info.description or comments.get(name, ""),
            )
        )
    return rows


def model_sections(
    model: type[BaseModel], prefix: str = ""
) -> Iterator[tuple[str, type[BaseModel], list[Row]]]:
    """(path, model, rows) for a model and, depth first, every model nested in its fields."""
    yield prefix.rstrip("."), model, model_rows(model, prefix)
    for name, info in model.model_fields.items():
        nested = _nested_model(info.annotation)
        if nested:
            yield from model_sections(nested[0], f"{prefix}{name}{nested[1]}.")


def _model_doc(model: type[BaseModel]) -> str:
    doc = inspect.getdoc(model) or ""
    inherited = any(doc == inspect.getdoc(base) for base in model.__mro__[1:] if base is not model)
    return "" if inherited else doc


def models_page(
    title: str,
    intro: str,
    root: type[BaseModel],
    root_label: str,
    extra: Callable[[str], str] | None = None,
    extra_header: str | None = None,
) -> str:
    out = [f"# {title}\n\n", intro.strip() + "\n"]
    for path, model, rows in model_sections(root):
        out.append(f"\n## `{path}`\n\n" if path else f"\n## {root_label}\n\n")
        doc = _model_doc(model)
        if doc:
            out.append(doc + "\n\n")
        fields = [
            row
            for row in rows
            if row.type != "section" and not row.type.startswith(("list of section", "map of str to section"))
        ]
        nested = [row.name for row in rows if row not in fields]
        if extra:
            for row in fields:
                row.extra = extra(row.name)
        if fields:
            out.append(table(fields, extra_header))
        if nested:
            out.append("\nSections: " + ", ".join(f"`{name}`" for name in nested) + " (below).\n")
    return "".join(out)


def dataclass_rows(cls: type) -> list[Row]:
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    rows = []
    for item in dataclasses.fields(cls):
        if item.default is not dataclasses.MISSING:
            default = default_text(item.default)
        else:
            default = factory_default(item.default_factory)
        rows.append(
            Row(
                name=item.name,
                type=type_text(hints.get(item.name, item.type)),
                default=default,
                description=item.metadata.get("help") or comments.get(item.name, ""),
            )
        )
    return rows


def settings_rows(cls: type) -> list[Row]:
    """Rows for a settings class, whether a dataclass or a pydantic model."""
    if inspect.isclass(cls) and issubclass(cls, BaseModel):
        return model_rows(cls)
    return dataclass_rows(cls)
