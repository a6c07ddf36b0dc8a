"""The `ctxgate` command line.

Each package contributes its own commands through a `register(subparsers)` function in its `cli`
module; those modules stay import-light (no torch at import time) so `ctxgate --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMAND_MODULES = ("backend.cli", "gateway.cli", "compression.cli", "eval.cli")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctxgate", description=__doc__.splitlines()[0])
    # Checked here so a typo is a usage error, not a traceback from logging.basicConfig.
    parser.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
        help=f"logging level: {', '.join(LOG_LEVELS)} (default INFO)",
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
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
