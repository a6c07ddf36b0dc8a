"""The `ctxgate` command line.

Each package contributes its own commands through a `register(subparsers)` function in its `cli`
module; those modules stay import-light (no torch at import time) so `ctxgate --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMAND_MODULES = (
    "ctxgate.backend.serving.cli",
    "ctxgate.gateway.cli",
    "ctxgate.compression.cli",
    "ctxgate.eval.cli",
)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctxgate", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    # Checked here so a typo is a usage error, not a traceback from logging.basicConfig. None, not
    # INFO: `serve --config` may set the level unless a --log-level was really given.
    parser.add_argument(
        "--log-level", default=None, type=str.upper, choices=LOG_LEVELS, metavar="LEVEL", help=LOG_LEVEL_HELP
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue
            raise
        module.register(subparsers)
    _accept_log_level_everywhere(subparsers)
    return parser


LOG_LEVEL_HELP = "logging level: DEBUG, INFO, WARNING, ERROR (default INFO)"


def _version() -> str:
    from ctxgate import __version__

    return __version__


def _accept_log_level_everywhere(subparsers: argparse._SubParsersAction) -> None:
    """`ctxgate serve --log-level DEBUG` works like `ctxgate --log-level DEBUG serve`."""
    for parser in set(subparsers.choices.values()):
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for action in nested:
            _accept_log_level_everywhere(action)
        if not nested and "--log-level" not in parser._option_string_actions:
            # SUPPRESS: when absent here, the value given before the subcommand (if any) stays.
            parser.add_argument("--log-level", default=argparse.SUPPRESS, help=LOG_LEVEL_HELP)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.log_level_given = args.log_level is not None
    args.log_level = (args.log_level or "INFO").upper()
    if args.log_level not in logging.getLevelNamesMapping():
        parser.error(f"--log-level: unknown level '{args.log_level}' (use DEBUG, INFO, WARNING or ERROR)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # bm25s pins its own logger to DEBUG when imported (lazily, on the first request), which would
    # log every per-request index build; a filter outlives that setLevel call.
    logging.getLogger("bm25s").addFilter(lambda record: record.levelno >= logging.WARNING)
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        return 130
    except (FileNotFoundError, ValueError) as exc:
        print(f"ctxgate: error: {exc}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
