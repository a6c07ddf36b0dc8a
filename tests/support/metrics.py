"""Reading a Prometheus exposition the way a scraper would."""

from __future__ import annotations


def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric_name = head.split("{", 1)[0]
        if metric_name != name:
            continue
        if all(f'{key}="{val}"' in head for key, val in labels.items()):
            total += float(value)
    return total
