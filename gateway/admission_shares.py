"""Tenants' weighted shares of the gateway's admission places: who gets a freed slot, who is shed.

A tenant's load is the requests it holds, running and queued, divided by its weight (the keys file's
`weight`, the same one the engine's fair queue uses). A freed slot goes to the waiter whose tenant has
the lowest load (the oldest such waiter); when the queue is full, the newest waiter of the tenant with
the highest load is shed for a newcomer whose tenant's load, counting the newcomer, would be lower. A
tenant never sheds its own waiters, and requests without a tenant (open mode) all share one, so there
the queue stays first come, first served.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Admittee:
    """Who asks for an admission place: the API key's id (its own caps) and its tenant's share."""

    key: str
    tenant: str
    weight: float = 1.0


def _tenant(who: Admittee | None) -> str | None:
    return who.tenant if who is not None else None


def _weight(who: Admittee | None) -> float:
    return who.weight if who is not None else 1.0


class TenantShares:
    """Requests running per tenant; the choice of the next waiter and of the one to shed."""

    def __init__(self) -> None:
        self._running: dict[str | None, int] = {}

    def running(self, tenant: str | None) -> int:
        return self._running.get(tenant, 0)

    def started(self, who: Admittee | None) -> None:
        tenant = _tenant(who)
        self._running[tenant] = self._running.get(tenant, 0) + 1

    def finished(self, who: Admittee | None) -> None:
        tenant = _tenant(who)
        left = self._running.get(tenant, 0) - 1
        if left > 0:
            self._running[tenant] = left
        else:
            self._running.pop(tenant, None)  # tenants with nothing running take no memory

    def next_in_line(self, waiting: Sequence[Admittee | None]) -> int:
        """The index of the waiter a freed slot goes to: its tenant's load lowest, then the oldest."""
        held = self._held(waiting)
        return min(
            range(len(waiting)),
            key=lambda index: (held[_tenant(waiting[index])] / _weight(waiting[index]), index),
        )

    def _held(self, waiting: Sequence[Admittee | None]) -> dict[str | None, int]:
        held = dict(self._running)
        for who in waiting:
            held[_tenant(who)] = held.get(_tenant(who), 0) + 1
        return held

    def victim(self, waiting: Sequence[Admittee | None], newcomer: Admittee | None) -> int | None:
        """The index of the waiter to shed so `newcomer` can queue, or None to refuse the newcomer."""
        held = self._held(waiting)
        newest: dict[str | None, int] = {}
        weight: dict[str | None, float] = {}
        for index, who in enumerate(waiting):
            tenant = _tenant(who)
            newest[tenant] = index
            weight[tenant] = _weight(who)
        if not newest:
            return None
        top = max(newest, key=lambda tenant: (held[tenant] / weight[tenant], newest[tenant]))
        newcomer_tenant = _tenant(newcomer)
        newcomer_load = (held.get(newcomer_tenant, 0) + 1) / _weight(newcomer)
        if top == newcomer_tenant or held[top] / weight[top] <= newcomer_load:
            return None
        return newest[top]
