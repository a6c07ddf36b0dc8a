"""Command-line flags generated from pydantic settings models, so each setting is defined once.

A field `max_num_seqs` becomes `--max-num-seqs` (dest: the field name) with the field's type, its
choices (a `Literal` or an `Enum`), its description as the help and its constraints: a value is
validated through the field itself while parsing, so a bad one is a usage error naming the flag.
A bool field takes `--flag/--no-flag`, a list field is repeatable. Flags have no argparse default
unless asked for: a dest absent after parsing was not given, so a config file and then the model's
own default apply. Older spellings of a flag are declared on the field with `Cli(old=...)` and keep
working with a deprecation notice.

Import-light (argparse and pydantic only): `ctxgate --help` builds every parser.
"""

from __future__ import annotations

import argparse
import enum
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from ctxgate.backend.settings.cli_actions import warn_deprecated


@dataclass(frozen=True)
class Cli:
    """Command-line details of a settings field (in its `Annotated[...]` metadata)."""

    old: tuple[str, ...] = ()  # earlier spellings of the flag: still accepted, with a notice
    replacement: str | None = None  # the whole flag is deprecated in favour of this one
    metavar: str | None = None


def kebab(name: str) -> str:
    return "--" + name.replace("_", "-")


def cli_of(info: FieldInfo) -> Cli:
    return next((item for item in info.metadata if isinstance(item, Cli)), Cli())


def error_text(error: Any) -> str:
    """A pydantic error's reason without pydantic's "Value error, " prefix on our own messages."""
    if error.get("type") == "value_error" and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    return error["msg"]


def describe_errors(
    exc: ValidationError, name_of: Callable[[str], str] = str, root: str = "settings"
) -> list[str]:
    """One line per problem: where (the field through `name_of`; `root` for the whole model) and why."""
    lines = []
    for error in exc.errors(include_url=False):
        loc = [str(part) for part in error["loc"]]
        where = ".".join([name_of(loc[0]), *loc[1:]]) if loc else root
        lines.append(f"{where}: {error_text(error)}")
    return lines


# -- types ---------------------------------------------------------------------------------------


def _without_none(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _choices(annotation: Any) -> list[Any] | None:
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [member.value for member in annotation]
    return None


def _field_adapter(info: FieldInfo) -> TypeAdapter:
    """Validates one value exactly as the model validates this field (constraints and validators)."""
    metadata = [item for item in info.metadata if not isinstance(item, Cli)]
    annotation = Annotated[(info.annotation, *metadata)] if metadata else info.annotation
    return TypeAdapter(annotation)


def _converter(name: str, info: FieldInfo, base: type) -> Callable[[str], Any]:
    """An argparse `type`: the base conversion (argparse says "invalid int value" when it fails),
    then the field's own validation (its reason becomes the usage error)."""
    adapter = _field_adapter(info) if typing.get_origin(_without_none(info.annotation)) is not list else None

    def convert(text: str) -> Any:
        value = base(text)
        if adapter is None:
            return value
        try:
            return adapter.validate_python(value)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError("; ".join(error_text(e) for e in exc.errors())) from None

    convert.__name__ = base.__name__  # argparse names the type in "invalid int value: 'x'"
    return convert


# -- actions -------------------------------------------------------------------------------------


class _OldSpellings:
    """Mixed into an argparse action: the option strings in `old_spellings` say they are deprecated."""

    old_spellings: tuple[str, ...] = ()
    replacement: str | None = None

    def __call__(self, parser, namespace, values, option_string=None):
        if self.replacement is not None:
            warn_deprecated(option_string or self.option_strings[0], self.replacement)
        elif option_string in self.old_spellings:
            primary = self.option_strings[0]
            if option_string.startswith("--no-") and isinstance(self, argparse.BooleanOptionalAction):
                primary = "--no-" + primary[2:]
            warn_deprecated(option_string, primary)
        super().__call__(parser, namespace, values, option_string)


_ACTION_CLASSES: dict[type, type] = {}


def _with_old_spellings(base: type[argparse.Action]) -> type[argparse.Action]:
    if base not in _ACTION_CLASSES:
        _ACTION_CLASSES[base] = type(f"Deprecating{base.__name__.lstrip('_')}", (_OldSpellings, base), {})
    return _ACTION_CLASSES[base]


def _help(info: FieldInfo, cli: Cli, default: Any) -> str:
    text = (info.description or "").replace("%", "%%")
    if cli.replacement:
        text = f"deprecated: use {cli.replacement}. {text}"
    if (
        default not in (None, False, [], argparse.SUPPRESS, PydanticUndefined)
        and info.default_factory is None
    ):
        text += f" (default {default})"
    if cli.old:
        text += f" ({', '.join(cli.old)}: deprecated spelling)"
    return text


_METAVARS = {int: "N", float: "X", Path: "PATH"}


def add_field_flag(
    parser: argparse.ArgumentParser | argparse._ActionsContainer,
    name: str,
    info: FieldInfo,
    default: Any = argparse.SUPPRESS,
) -> argparse.Action:
    """Add the flag of one settings field to `parser`."""
    cli = cli_of(info)
    annotation = _without_none(info.annotation)
    option_strings = [kebab(name), *(old for old in cli.old if not old.startswith("--no-"))]
    kwargs: dict[str, Any] = {"dest": name, "default": default}
    if annotation is bool:
        action_class: type[argparse.Action] = argparse.BooleanOptionalAction
    elif typing.get_origin(annotation) is list:
        item = (typing.get_args(annotation) or (str,))[0]
        action_class = argparse._AppendAction
        kwargs["type"] = _converter(name, info, item if item in (int, float) else str)
        kwargs["metavar"] = cli.metavar or "VALUE"
    else:
        action_class = argparse._StoreAction
        choices = _choices(annotation)
        if choices is not None:
            kwargs["choices"] = choices
            kwargs["type"] = type(choices[0])
        else:
            base = annotation if annotation in (int, float) else str
            kwargs["type"] = _converter(name, info, base)
            kwargs["metavar"] = cli.metavar or _METAVARS.get(annotation, "TEXT")
    model_default = info.default if info.default is not PydanticUndefined else None
    kwargs["help"] = _help(info, cli, model_default)
    action = parser.add_argument(*option_strings, action=_with_old_spellings(action_class), **kwargs)
    old = set(cli.old)
    if annotation is bool:
        old |= {"--no-" + spelling[2:] for spelling in cli.old if not spelling.startswith("--no-")}
    action.old_spellings = tuple(sorted(old & set(action.option_strings)))
    action.replacement = cli.replacement
    return action


def _help_groups(
    parser: argparse.ArgumentParser, model: type[BaseModel], title: str | None
) -> dict[str, argparse._ActionsContainer]:
    """Field name -> the `--help` section its flag is listed in: the model's `CLI_GROUPS` (section
    title -> field names), else the section `title` (else the parser's own options)."""
    sections: dict[str, argparse._ActionsContainer] = {}
    for section, names in getattr(model, "CLI_GROUPS", {}).items():
        group = parser.add_argument_group(section)
        sections.update(dict.fromkeys(names, group))
    fallback = parser.add_argument_group(title) if title else parser
    return {name: sections.get(name, fallback) for name in model.model_fields}


def add_model_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    *,
    skip: Iterable[str] = (),
    defaults: bool = False,
    title: str | None = None,
) -> dict[str, argparse.Action]:
    """Add a flag for every field of `model` (but `skip`); returns them by field name.

    `defaults=False`: no argparse defaults (a dest absent after parsing was not given).
    `defaults=True`: each dest defaults to the model's static default (None where it is computed).
    Fields named together in the model's `EXCLUSIVE` groups become mutually exclusive flags.
    `--help` lists the flags in the sections of the model's `CLI_GROUPS`; the others under `title`.
    """
    skip = set(skip)
    groups = _help_groups(parser, model, title)
    for names in getattr(model, "EXCLUSIVE", ()):
        group = groups[names[0]].add_mutually_exclusive_group()
        groups.update(dict.fromkeys(names, group))
    actions = {}
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        if defaults:
            default = None if info.default is PydanticUndefined else info.default
        else:
            default = argparse.SUPPRESS
        actions[name] = add_field_flag(groups[name], name, info, default)
    return actions


def given_values(
    args: argparse.Namespace, model: type[BaseModel], skip: Sequence[str] = ()
) -> dict[str, Any]:
    """The fields of `model` present in `args` (with SUPPRESS defaults: the flags really given)."""
    return {
        name: getattr(args, name) for name in model.model_fields if name not in skip and hasattr(args, name)
    }


def static_defaults(model: type[BaseModel], skip: Iterable[str] = ()) -> dict[str, Any]:
    """Field name -> the model's default, for fields whose default is not computed at start-up."""
    return {
        name: info.default
        for name, info in model.model_fields.items()
        if name not in set(skip) and info.default is not PydanticUndefined and info.default_factory is None
    }
