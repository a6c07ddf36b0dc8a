"""The sliding window of the per-minute limits: at most the limit in ANY 60-second span.

The rule: each meter keeps one counter per second (a bucket, numbered `floor(t)`), and a reservation
at `now` is checked against the sum of every bucket that may hold an amount from the last 60
seconds: buckets `b >= floor(now - 60)`. Whatever was admitted within 60 s before `now` is in those
buckets, so no 60-second span ever holds more than the limit, across any minute boundary. The cost
of counting whole buckets: an amount is counted for up to 61 s instead of 60 (a wait at most one
second longer than an exact log would give), and a meter holds at most 61 buckets, whatever the
traffic: bounded memory per tenant, key and model, in the process and in Redis alike (a hash of at
most 61 fields, plus at most a second of clock skew between replicas).

A reservation lands in the bucket of its own second; its reconcile credits the difference back to
that bucket (a request reserved at t and settled at t + 5 s gives back what it did not use at t),
never to a bucket that has already left the window.

A plain token bucket (GCRA) with a burst of the limit lets a tenant take about twice the limit in
some 60-second span; this rule does not. The Redis store runs the same rule in its Lua scripts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

WINDOW_S = 60
GRANULE_S = 1  # one bucket per second: `bucket_of` and the Lua scripts agree on it


def bucket_of(now: float) -> int:
    return math.floor(now / GRANULE_S)


def oldest_counted(now: float) -> int:
    """The oldest bucket that may hold an amount from the last WINDOW_S seconds before `now`."""
    return math.floor((now - WINDOW_S) / GRANULE_S)


def level(buckets: Mapping[int, int], now: float) -> int:
    oldest = oldest_counted(now)
    return sum(amount for bucket, amount in buckets.items() if bucket >= oldest)


def _leaves_at(bucket: int) -> float:
    """The first moment `bucket` is no longer counted."""
    return (bucket + 1) * GRANULE_S + WINDOW_S


def wait_for_room(buckets: Mapping[int, int], now: float, amount: int, limit: int) -> int:
    """Whole seconds until `amount` fits under `limit`, as the oldest buckets leave the window (at
    least 1). An amount over the limit never fits: a whole window then (the caller refuses it)."""
    used = level(buckets, now)
    oldest = oldest_counted(now)
    for bucket in sorted(b for b in buckets if b >= oldest):
        used -= buckets[bucket]
        if used + amount <= limit:
            return max(1, math.ceil(_leaves_at(bucket) - now))
    return WINDOW_S


def seconds_to_empty(buckets: Mapping[int, int], now: float) -> int:
    """Until every amount counted now has left the window (OpenAI's `x-ratelimit-reset-*`)."""
    oldest = oldest_counted(now)
    live = [bucket for bucket, amount in buckets.items() if bucket >= oldest and amount > 0]
    return max(1, math.ceil(_leaves_at(max(live)) - now)) if live else 1
