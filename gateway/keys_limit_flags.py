"""The limit flags of `ctxgate keys add` (a key's own limits, on top of its tenant's) and the `Limits`
they build: every number is checked where it is parsed, so `--budget inf` or `--tokens-per-week -5`
is refused naming its flag before the keys file is touched."""

from __future__ import annotations

import argparse
import math

# Beyond any real limit; keeps the ledger's integer arithmetic bounded (the console's forms too).
MAX_LIMIT = 10**15


def whole_number(text: str) -> int:
    """argparse type: a whole number from 1 to MAX_LIMIT."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"'{text[:40]}' is not a whole number from 1 to {MAX_LIMIT:g}")
    return value


def amount(text: str) -> float:
    """argparse type: a finite number above 0 and at most MAX_LIMIT (not inf, nan or negative)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_LIMIT):
        raise argparse.ArgumentTypeError(
            f"'{text[:40]}' is not a finite number above 0 and at most {MAX_LIMIT:g}"
        )
    return value


def time_zone(text: str) -> str:
    """argparse type: an IANA time zone name."""
    from ctxgate.policies.schema import check_time_zone

    try:
        return check_time_zone(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# (flag, type, help): each flag's value lands in the `Limits` field of the same name.
_COUNTS = (
    ("--requests-per-minute", whole_number, "per-key request limit per minute"),
    ("--tokens-per-minute", whole_number, "per-key limit on prompt + reserved output tokens per minute"),
    ("--tokens-per-day", whole_number, "per-key prompt + completion tokens per calendar day"),
    ("--tokens-per-week", whole_number, "per-key prompt + completion tokens per calendar week (from Monday)"),
    ("--tokens-per-month", whole_number, "per-key prompt + completion tokens per calendar month"),
    ("--spend-per-day", amount, "per-key spend per calendar day, in the policy's cost units"),
    ("--max-parallel-requests", whole_number, "per-key limit on generation requests in flight at once"),
    ("--budget", amount, "per-key spend allowed per --budget-period, in the policy's cost units"),
)
LIMIT_DESTS = tuple(flag[2:].replace("-", "_") for flag, _, _ in _COUNTS) + (
    "budget_period",
    "window",
    "time_zone",
)


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    for flag, kind, help_text in _COUNTS:
        parser.add_argument(flag, type=kind, default=None, metavar="N", help=help_text)
    parser.add_argument(
        "--budget-period",
        choices=["daily", "weekly", "monthly"],
        default=None,
        help="window of --budget: calendar day / week from Monday / month in the time zone (default monthly)",
    )
    parser.add_argument(
        "--window",
        choices=["sliding", "fixed"],
        default=None,
        help="the per-minute limits: sliding (any 60 seconds) or fixed (calendar minutes); default: the tenant's",
    )
    parser.add_argument(
        "--time-zone",
        type=time_zone,
        default=None,
        metavar="ZONE",
        help="IANA zone where this key's days, weeks and months begin (e.g. Europe/Berlin); default: the tenant's",
    )


def limits_from_args(args: argparse.Namespace):
    """The key's `Limits` from the parsed flags; ValueError for a combination the file would refuse."""
    from ctxgate.gateway.keys import Limits

    if args.budget_period and args.budget is None:
        raise ValueError("--budget-period needs --budget")
    return Limits(**{dest: getattr(args, dest) for dest in LIMIT_DESTS})
