from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from ctxgate.compression.knapsack import knapsack


def brute_force_best(values, costs, budget):
    best = 0.0
    for size in range(len(values) + 1):
        for subset in combinations(range(len(values)), size):
            if sum(costs[i] for i in subset) <= budget:
                best = max(best, sum(values[i] for i in subset))
    return best


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(st.tuples(st.floats(0.01, 10), st.integers(1, 40)), min_size=0, max_size=9),
    budget=st.integers(0, 120),
)
def test_knapsack_is_optimal_and_within_budget(items, budget):
    values = [value for value, _ in items]
    costs = [cost for _, cost in items]
    chosen = knapsack(values, costs, budget)
    assert sum(costs[i] for i in chosen) <= budget
    assert sorted(set(chosen)) == chosen
    assert abs(sum(values[i] for i in chosen) - brute_force_best(values, costs, budget)) < 1e-6


def test_large_budgets_are_coarsened_but_never_exceeded():
    values = [1.0 + (i % 7) for i in range(300)]
    costs = [37 + (i * 13) % 301 for i in range(300)]
    budget = 20_000
    chosen = knapsack(values, costs, budget)
    assert sum(costs[i] for i in chosen) <= budget
    assert len(chosen) > 50
