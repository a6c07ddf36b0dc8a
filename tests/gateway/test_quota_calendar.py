"""Token and spend budgets per day, week and month, calendar-aligned in the quota's time zone: the
windows themselves (DST-safe), a monthly budget resetting at local midnight of the first (clock test,
both stores), and two replicas on one Redis seeing the same reset."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from pydantic import ValidationError

from ctxgate.gateway.quota import InProcessQuotaStore, QuotaExceeded, QuotaLimits, RedisQuotaStore
from ctxgate.gateway.quota.calendar import calendar_window
from ctxgate.policies.schema import QuotaPolicy
from tests.gateway.clock import FakeClock


def local(text: str, zone: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(zone)).timestamp()


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        yield InProcessQuotaStore()
        return
    redis_store = RedisQuotaStore(request.getfixturevalue("redis_server").url)
    yield redis_store
    await redis_store.close()


@pytest.mark.parametrize(
    "zone", ["UTC", "Europe/Berlin", "America/New_York", "America/Santiago", "Asia/Kolkata"]
)
def test_days_weeks_and_months_follow_the_local_calendar_through_a_year(zone):
    tz = ZoneInfo(zone)
    lengths = set()
    for period, step in (("day", 1), ("week", 7)):
        now = local("2026-01-01T12:00:00", zone)
        window = calendar_window(period, now, zone)
        for _ in range(400 // step):
            following = calendar_window(period, window.end, zone)
            assert following.number == window.number + 1
            # The end is the first instant of the next local day (or Monday): one second before is
            # still this window's last local day.
            first, last = datetime.fromtimestamp(window.end, tz), datetime.fromtimestamp(window.end - 1, tz)
            assert first.date() == last.date() + timedelta(days=1)
            assert first.hour <= 1 and (period == "day" or first.weekday() == 0)
            if period == "day":
                lengths.add(round((following.end - window.end) / 3600))
            window = following
    assert lengths <= {23, 24, 25} and (zone in ("UTC", "Asia/Kolkata")) == (lengths == {24})
    month = calendar_window("month", local("2026-02-14T10:00:00", zone), zone)
    assert datetime.fromtimestamp(month.end, tz).date() == date(2026, 3, 1)


def test_utc_windows_keep_the_ledger_numbers_of_the_fixed_windows():
    now = 1_700_000_000.0  # a Tuesday
    assert calendar_window("day", now).number == int(now // 86400)
    assert calendar_window("week", now).number == int((now + 3 * 86400) // (7 * 86400))
    assert calendar_window("monthly", now).number == 2023 * 12 + 10


def test_a_time_zone_must_be_one_zoneinfo_knows():
    for name in ("Mars/Olympus_Mons", "../../etc/passwd", ""):
        with pytest.raises(ValidationError, match="time zone"):
            QuotaPolicy(time_zone=name)
    assert QuotaPolicy(time_zone="Europe/Berlin").time_zone == "Europe/Berlin"


async def test_a_monthly_token_budget_resets_at_local_midnight_of_the_first(store):
    zone = "America/New_York"
    limits = QuotaLimits(tokens_per_month=1000, time_zone=zone)
    await store.reserve("m", limits, 1000, 0, now=local("2026-11-01T00:00:00", zone))
    # 00:30 UTC on 1 December is still November in New York: a UTC month would have started.
    with pytest.raises(QuotaExceeded) as refused:
        await store.reserve("m", limits, 1, 0, now=datetime(2026, 12, 1, 0, 30, tzinfo=UTC).timestamp())
    assert (refused.value.reason, refused.value.retry_after_s) == ("tokens_per_month", 4 * 3600 + 1800)
    assert refused.value.usage.resets_at == "2026-12-01T00:00:00-05:00"
    assert "1000 of 1000 tokens a month used" in str(refused.value)
    with pytest.raises(QuotaExceeded):
        await store.reserve("m", limits, 1, 0, now=local("2026-11-30T23:59:59", zone))
    await store.reserve("m", limits, 1000, 0, now=local("2026-12-01T00:00:00", zone))


async def test_a_weekly_spend_budget_and_token_day_in_one_zone(store):
    zone = "Europe/Berlin"
    limits = QuotaLimits(budget=1.0, budget_period="weekly", tokens_per_day=100, time_zone=zone)
    sunday_night = local("2026-03-29T23:00:00", zone)  # the 23-hour day DST starts on
    await store.reserve("w", limits, 100, 1_000_000, now=sunday_night)
    with pytest.raises(QuotaExceeded) as refused:
        await store.reserve("w", limits, 1, 1, now=sunday_night + 1800)
    assert refused.value.reason == "tokens_per_day" and refused.value.retry_after_s == 1800
    usage = {u.name: u for u in await store.usage("w", limits, now=sunday_night + 1800)}
    assert usage["budget"].resets_at == "2026-03-30T00:00:00+02:00" and usage["budget"].used == 1_000_000
    await store.reserve("w", limits, 100, 1_000_000, now=local("2026-03-30T00:00:00", zone))


async def test_two_replicas_on_one_redis_reset_the_month_together(redis_server):
    zone = "Asia/Tokyo"
    limits = QuotaLimits(tokens_per_month=1000, time_zone=zone)
    clock = FakeClock(local("2026-12-31T20:00:00", zone))
    replicas = [
        RedisQuotaStore(redis_server.url, clock=clock),
        RedisQuotaStore(redis_server.url, clock=clock),
    ]
    try:
        await replicas[0].reserve("tokyo", limits, 600, 0)
        await replicas[1].reserve("tokyo", limits, 400, 0)
        for replica in replicas:
            with pytest.raises(QuotaExceeded) as refused:
                await replica.reserve("tokyo", limits, 1, 0)
            assert refused.value.usage.resets_at == "2027-01-01T00:00:00+09:00"
        clock.now = local("2027-01-01T00:00:00", zone)  # 15:00 UTC on 31 December
        await replicas[1].reserve("tokyo", limits, 1000, 0)
        with pytest.raises(QuotaExceeded):
            await replicas[0].reserve("tokyo", limits, 1, 0)
        (month,) = await replicas[0].usage("tokyo", limits)
        assert (month.used, month.resets_at) == (1000, "2027-02-01T00:00:00+09:00")
    finally:
        for replica in replicas:
            await replica.close()
