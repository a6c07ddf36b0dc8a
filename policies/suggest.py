""" "Did you mean" for a misspelt field: the close matches among the fields a model does have."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds: itself, or inside Optional / list / dict / Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list, dict, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def field_suggestion(model: type[BaseModel], loc: Sequence[str | int]) -> str | None:
    """`did you mean 'x'?` for an unknown field at `loc` (its dotted path from `model`), or None."""
    owner: type[BaseModel] | None = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # a list index: the same item model
        info = owner.model_fields.get(str(part)) if owner is not None else None
        owner = _model_in(info.annotation) if info is not None else None
        if owner is None:
            return None
    if owner is None or not loc:
        return None
    matches = difflib.get_close_matches(str(loc[-1]), list(owner.model_fields), n=1, cutoff=0.6)
    return f"did you mean '{matches[0]}'?" if matches else None
