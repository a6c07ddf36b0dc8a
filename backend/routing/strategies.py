"""Which deployment of a model group takes a request: least outstanding requests (the default),
smooth weighted round robin, or cache affinity by consistent hashing with bounded load.

A strategy only orders the group's deployments (most preferred first); the group then skips the
ones ejected or at their parallel limit and fails over down the list. The affinity ring is built
from the deployments' names alone, so every gateway replica computes the same ring with no shared
state; the load each replica bounds by is its own count of requests in flight, and the deployment
it remembers as having served a key last is what its own traffic taught it.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

Strategy = Literal["least_outstanding", "weighted_round_robin", "cache_affinity"]
STRATEGIES: tuple[Strategy, ...] = ("least_outstanding", "weighted_round_robin", "cache_affinity")
# Points per unit of weight on the ring: enough that two deployments split keys within a few percent.
RING_POINTS = 160
# Keys whose last deployment a gateway remembers (LRU): ~100 bytes each, so a few MB at most.
REMEMBERED_KEYS = 50_000


class Slot(Protocol):
    """What a strategy knows of a deployment."""

    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> float: ...

    @property
    def in_flight(self) -> int: ...


@dataclass(frozen=True)
class Choice:
    """Deployments in the order to try them; `affine` names the deployment expected to hold the
    request's prefix (the one that served its key last, else the ring owner; None when the strategy
    does not use one), so the group can count affinity hits."""

    order: list[int]
    affine: int | None = None


class Router(Protocol):
    def choose(self, slots: Sequence[Slot], key: str | None) -> Choice: ...

    def served(self, key: str | None, name: str) -> None:
        """The deployment called `name` started streaming the request with `key`."""
        ...


class LeastOutstanding:
    """Fewest requests in flight per unit of weight; ties go round in turn, so an idle group
    still spreads its requests."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, slots: Sequence[Slot], key: str | None) -> Choice:
        turn = next(self._turn)
        count = len(slots)
        order = sorted(range(count), key=lambda i: (slots[i].in_flight / slots[i].weight, (i - turn) % count))
        return Choice(order)

    def served(self, key: str | None, name: str) -> None:
        pass


class WeightedRoundRobin:
    """nginx's smooth weighted round robin: over sum(weights) picks each deployment is first
    `weight` times, interleaved; the others follow in ring order for failover."""

    def __init__(self) -> None:
        self._current: dict[str, float] = {}

    def choose(self, slots: Sequence[Slot], key: str | None) -> Choice:
        total = sum(slot.weight for slot in slots)
        for slot in slots:
            self._current[slot.name] = self._current.get(slot.name, 0.0) + slot.weight
        first = max(range(len(slots)), key=lambda i: self._current[slots[i].name])
        self._current[slots[first].name] -= total
        return Choice([first, *(i for i in range(len(slots)) if i != first)])

    def served(self, key: str | None, name: str) -> None:
        pass


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class CacheAffinity:
    """Consistent hashing with bounded load (Mirrokni, Thorup, Zadimoghaddam 2018): a key goes to
    the first deployment clockwise from its point on the ring whose requests in flight are under
    `load_factor` times its weighted share of the group's (this one included); a busier owner
    spills to the next on the ring. Keys with no prefix to share fall back to least outstanding.

    After a spill the prefix lives on the deployment that took the request, not on the ring owner;
    so the deployment that last served a key comes first for it (under the same bound), and the
    ring decides only for keys this gateway has not served (or has forgotten, LRU)."""

    def __init__(self, load_factor: float = 1.25) -> None:
        if load_factor < 1:
            raise ValueError("load_factor must be at least 1")
        self.load_factor = load_factor
        self._fallback = LeastOutstanding()
        self._ring_of: tuple[tuple[str, float], ...] = ()
        self._points: list[int] = []
        self._owners: list[int] = []
        self._last_served: OrderedDict[str, str] = OrderedDict()

    def _ring(self, slots: Sequence[Slot]) -> None:
        shape = tuple((slot.name, slot.weight) for slot in slots)
        if shape == self._ring_of:
            return
        entries = sorted(
            (_point(f"{slot.name}#{replica}"), index)
            for index, slot in enumerate(slots)
            for replica in range(max(1, round(RING_POINTS * slot.weight)))
        )
        self._points = [point for point, _ in entries]
        self._owners = [owner for _, owner in entries]
        self._ring_of = shape

    def walk(self, slots: Sequence[Slot], key: str) -> list[int]:
        """Every deployment once, in ring order from the key's point."""
        self._ring(slots)
        start = bisect.bisect(self._points, _point(key))
        seen: dict[int, None] = {}
        for step in range(len(self._points)):
            seen.setdefault(self._owners[(start + step) % len(self._points)], None)
            if len(seen) == len(slots):
                break
        return list(seen)

    def capacity(self, slots: Sequence[Slot], index: int) -> int:
        total_weight = sum(slot.weight for slot in slots)
        load = sum(slot.in_flight for slot in slots) + 1  # the request being placed
        return max(1, math.ceil(self.load_factor * load * slots[index].weight / total_weight))

    def choose(self, slots: Sequence[Slot], key: str | None) -> Choice:
        if key is None:
            return self._fallback.choose(slots, key)
        walk = self.walk(slots, key)
        last = self._last_served.get(key)
        holder = next((i for i in walk if slots[i].name == last), None)
        if holder is not None:
            walk.remove(holder)
            walk.insert(0, holder)
        under = [i for i in walk if slots[i].in_flight < self.capacity(slots, i)]
        over = [i for i in walk if i not in under]
        return Choice(under + over, affine=walk[0])

    def served(self, key: str | None, name: str) -> None:
        if key is None:
            return
        self._last_served[key] = name
        self._last_served.move_to_end(key)
        if len(self._last_served) > REMEMBERED_KEYS:
            self._last_served.popitem(last=False)


def make_router(strategy: Strategy, load_factor: float = 1.25) -> Router:
    if strategy == "weighted_round_robin":
        return WeightedRoundRobin()
    if strategy == "cache_affinity":
        return CacheAffinity(load_factor)
    return LeastOutstanding()
