"""What the `eval` and `bench` commands share: the gateway flags, quiet HTTP logs, and the eval
extra's check (the commands that need its packages name the install line)."""

from __future__ import annotations

import argparse
import importlib.util
import logging

from ctxgate.backend.settings.cli_actions import positive_number


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="a running gateway (default: start `ctxgate serve` on a free port)")
    parser.add_argument("--api-key", help="bearer key for a gateway with a keys file")
    parser.add_argument("--model", help="model for the in-process gateway (default: its default)")
    parser.add_argument("--policy-dir", help="policy directory for the in-process gateway")
    parser.add_argument("--limit", type=int, help="first N questions only")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def quiet_http_logs() -> None:
    # One INFO line per request would bury the progress bar.
    for name in ("httpx", "httpx2", "httpcore", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)


EVAL_EXTRA_HINT = "pip install 'ctxgate[eval]'"


def require_eval_extra(command: str, *modules: str) -> None:
    """Fail with the install line when a package of the `eval` extra is missing (a plain install
    runs the gateway and the engine without them)."""
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if missing:
        raise ValueError(f"`ctxgate {command}` needs {', '.join(missing)}: {EVAL_EXTRA_HINT}")


def rates_argument(text: str) -> list[float]:
    """argparse type: comma-separated positive request rates, e.g. 0.3,0.6,1.0 (ascending, once each)."""
    try:
        rates = sorted({positive_number(value.strip()) for value in text.split(",") if value.strip()})
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"--rates: {exc}") from None
    if not rates:
        raise argparse.ArgumentTypeError("expected rates such as 0.3,0.6,1.0")
    if len(rates) > 12:
        raise argparse.ArgumentTypeError("at most 12 rates")
    return rates
