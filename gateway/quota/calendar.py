"""Calendar windows in a time zone: the day, ISO week and month a moment falls in, and when each ends.

Budgets reset where the operator lives: at local midnight, on local Monday, on the local first of
the month, in the IANA zone a quota names (`time_zone`, default UTC). Boundaries come from local
dates through zoneinfo, so a day is 23 or 25 hours long across a DST change, and a zone that
springs forward at midnight starts its day at the transition (zoneinfo reads a missing midnight
with the offset before the change, which is the transition instant).

Window numbers are local calendar dates counted from 1970-01-01 (weeks from the Monday before it,
months as year * 12 + month - 1): every replica given the same time and zone names the same
window, and in UTC they are the numbers the ledger always used, so counters survive an upgrade.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta
from zoneinfo import ZoneInfo

from ctxgate.policies.schema import check_time_zone

__all__ = ["BUDGET_PERIODS", "CalendarWindow", "calendar_window", "check_time_zone", "iso_time", "zone"]

PERIODS = ("day", "week", "month")
BUDGET_PERIODS = ("daily", "weekly", "monthly")
_BUDGET_PERIOD = dict(zip(BUDGET_PERIODS, PERIODS, strict=True))
_EPOCH = date(1970, 1, 1)  # a Thursday: day + 3 counts weeks from Monday (ISO)


@functools.lru_cache(maxsize=256)
def zone(name: str) -> ZoneInfo:
    return ZoneInfo(name)


@dataclass(frozen=True)
class CalendarWindow:
    """One calendar day, week or month in a zone: its number (the ledger's key) and its end (epoch s)."""

    number: int
    end: float

    def seconds_left(self, now: float) -> int:
        """Whole seconds until the window ends, at least 1 (a Retry-After)."""
        return max(1, -int(-(self.end - now) // 1))


def _start_of(day: date, tz: ZoneInfo) -> float:
    return datetime.combine(day, time.min, tzinfo=tz).timestamp()


def calendar_window(period: str, now: float, time_zone: str = "UTC") -> CalendarWindow:
    """The `period` ("day", "week", "month", or a budget's "daily", "weekly", "monthly") that `now`
    falls in, in `time_zone`."""
    period = _BUDGET_PERIOD.get(period, period)
    tz = zone(time_zone)
    today = datetime.fromtimestamp(now, tz).date()
    if period == "day":
        return CalendarWindow((today - _EPOCH).days, _start_of(today + timedelta(days=1), tz))
    if period == "week":
        week = ((today - _EPOCH).days + 3) // 7
        next_monday = _EPOCH + timedelta(days=(week + 1) * 7 - 3)
        return CalendarWindow(week, _start_of(next_monday, tz))
    if period == "month":
        first_of_next = date(today.year + today.month // 12, today.month % 12 + 1, 1)
        return CalendarWindow(today.year * 12 + today.month - 1, _start_of(first_of_next, tz))
    raise ValueError(f"unknown calendar period '{period}' (use one of {', '.join(BUDGET_PERIODS)})")


def iso_time(moment: float, time_zone: str = "UTC") -> str:
    """`moment` in ISO 8601 with the zone's offset at that moment, to the second."""
    return datetime.fromtimestamp(round(moment), zone(time_zone)).isoformat()
