"""Budget allocation: a 0/1 knapsack over units (value = relevance, cost = tokens).

Exact dynamic programming, vectorized over capacities with numpy. For large budgets the costs are
scaled down by rounding *up*, so the chosen set can only be cheaper than the budget, never dearer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

MAX_CAPACITY_CELLS = 4096  # DP resolution; beyond it costs are coarsened (rounded up)


def knapsack(values: Sequence[float], costs: Sequence[int], budget: int) -> list[int]:
    """Indices (ascending) of the units maximizing total value with sum(costs) <= budget."""
    if budget <= 0 or not values:
        return [index for index, cost in enumerate(costs) if cost <= 0 and budget >= 0]
    if sum(max(cost, 0) for cost in costs) <= budget:
        return list(range(len(costs)))
    scale = max(1.0, budget / MAX_CAPACITY_CELLS)
    capacity = int(budget // scale)
    scaled_costs = [max(0, math.ceil(cost / scale)) for cost in costs]
    best = np.zeros(capacity + 1, dtype=np.float64)
    taken = np.zeros((len(values), capacity + 1), dtype=bool)
    for index, (value, cost) in enumerate(zip(values, scaled_costs, strict=True)):
        if value <= 0 or cost > capacity:
            continue
        if cost == 0:
            best += value
            taken[index, :] = True
            continue
        candidate = best[:-cost] + value
        improves = candidate > best[cost:]
        taken[index, cost:] = improves
        best[cost:] = np.where(improves, candidate, best[cost:])
    chosen: list[int] = []
    remaining = capacity
    for index in range(len(values) - 1, -1, -1):
        if taken[index, remaining]:
            chosen.append(index)
            remaining -= scaled_costs[index]
    chosen.reverse()
    # Guard the promise against any rounding surprise.
    while chosen and sum(costs[index] for index in chosen) > budget:
        chosen.remove(min(chosen, key=lambda index: values[index]))
    return chosen
