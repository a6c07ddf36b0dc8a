"""The CLI reference page: every `ctxgate` command and flag, read from the argparse parsers."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

from reference_gen.fields import Row, cell, default_text


def build_cli_parser() -> argparse.ArgumentParser:
    """The `ctxgate` root parser, built with an empty environment: some defaults read environment
    variables (`--redis-url`, API keys), and the build host's values must not reach the docs."""
    from ctxgate.cli import build_parser

    with mock.patch.dict(os.environ, {}, clear=True):
        return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _subparser(parser: argparse.ArgumentParser, path: list[str]) -> argparse.ArgumentParser:
    for name in path:
        parser = _subparsers(parser).choices[name]
    return parser


def cli_commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], str, argparse.ArgumentParser]]:
    """(command path, help, parser) for the root and every subcommand, depth first."""
    yield path, parser.description or "", parser
    sub = _subparsers(parser)
    if sub is None:
        return
    helps = {choice.dest: choice.help or "" for choice in sub._choices_actions}
    for name, child in sub.choices.items():
        if child is parser:
            continue
        for child_path, child_help, grandchild in cli_commands(child, (*path, name)):
            yield child_path, child_help or helps.get(name, ""), grandchild


def cli_option_rows(parser: argparse.ArgumentParser) -> list[Row]:
    deferred = parser.get_default("flag_defaults") or {}  # serve applies defaults after its config file
    formatter = argparse.HelpFormatter(parser.prog)
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        default = action.default
        if default is argparse.SUPPRESS:
            default = deferred.get(action.dest, argparse.SUPPRESS)
        if action.option_strings:
            name = ", ".join(action.option_strings)
        else:
            name = action.metavar or action.dest
        help_text = action.help or ""
        if "%" in help_text:
            help_text = formatter._expand_help(action)
        deprecated = getattr(action, "deprecated", ())
        if deprecated:
            help_text += f" ({', '.join(deprecated)}: deprecated spelling)"
        value = ""
        if action.choices:
            value = "one of " + ", ".join(str(choice) for choice in action.choices)
        elif action.nargs == 0:
            value = "switch"
        elif action.option_strings:
            value = action.metavar if isinstance(action.metavar, str) else _type_word(action.type)
            if isinstance(action, argparse._AppendAction):
                value += " (repeatable)"
        else:
            value = "positional" + (" (one or more)" if action.nargs == "+" else "")
        shown_default = (
            ""
            if default is argparse.SUPPRESS or (default in (None, False, []) and action.option_strings)
            else default_text(default)
        )
        rows.append(Row(name=name, type=value, default=shown_default, description=help_text))
    return rows


def _type_word(kind: Any) -> str:
    if kind is None or kind is str:
        return "text"
    return {int: "integer", float: "number"}.get(kind, getattr(kind, "__name__", "value"))


def cli_page() -> str:
    root = build_cli_parser()
    out = [
        "# CLI reference\n\n",
        "Every `ctxgate` command and flag, from the argparse parsers (`ctxgate/cli.py` and each "
        "package's `cli.py`; generated at build time). `ctxgate COMMAND --help` prints the same. "
        "Defaults that come from environment variables are named in the flag's help.\n",
    ]
    for path, help_text, parser in cli_commands(root):
        command = " ".join(("ctxgate", *path))
        out.append(f"\n## `{command}`\n\n")
        if help_text:
            out.append(help_text[0].upper() + help_text[1:].rstrip(".") + ".\n\n")
        rows = cli_option_rows(parser)
        sub = _subparsers(parser)
        if sub is not None:
            out.append("Subcommands: " + ", ".join(f"`{command} {name}`" for name in sub.choices) + ".\n\n")
        if rows:
            lines = ["| Argument | Value | Default | Description |", "| --- | --- | --- | --- |"]
            for row in rows:
                lines.append(
                    f"| {cell(row.name, True)} | {cell(row.type)} | {cell(row.default, True)} | "
                    f"{cell(row.description)} |"
                )
            out.append("\n".join(lines) + "\n")
    return "".join(out)
