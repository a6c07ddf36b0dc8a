"""The figures the console's savings page shows, read back from its HTML (the rows' data attributes
and cells), and the same counters from the gateway's /metrics."""

from __future__ import annotations

import html
import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

_ROW = re.compile(
    r'<tr class="saving" data-tenant="(?P<tenant>[^"]*)" data-policy="(?P<policy>[^"]*)">.*?'
    r'<td class="num before">(?P<before>\d+)</td>\s*<td class="num after">(?P<after>\d+)</td>\s*'
    r'<td class="num saved">(?P<saved>-?\d+)</td>\s*<td class="num completion">(?P<completion>\d+)</td>',
    re.S,
)
_OUTCOME = re.compile(
    r'<tr class="outcome" data-policy="(?P<policy>[^"]*)">.*?<td class="num fitted">(?P<fitted>\d+)</td>'
    r'<td class="num refused">(?P<refused>\d+)</td>',
    re.S,
)

Figures = dict[tuple[str, str], dict[str, int]]


def page_figures(page: str) -> Figures:
    return {
        (html.unescape(m["tenant"]), html.unescape(m["policy"])): {
            "before": int(m["before"]),
            "after": int(m["after"]),
            "saved": int(m["saved"]),
            "completion": int(m["completion"]),
        }
        for m in _ROW.finditer(page)
    }


def page_outcomes(page: str) -> dict[str, tuple[int, int]]:
    return {
        html.unescape(m["policy"]): (int(m["fitted"]), int(m["refused"])) for m in _OUTCOME.finditer(page)
    }


def metrics_figures(url: str) -> Figures:
    """prompt_tokens_original / _sent and completion_tokens per (tenant, policy), from /metrics."""
    names = {
        "ctxgate:prompt_tokens_original": "before",
        "ctxgate:prompt_tokens_sent": "after",
        "ctxgate:completion_tokens": "completion",
    }
    figures: Figures = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name not in names:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                row = figures.setdefault((sample.labels["tenant"], sample.labels["policy"]), {})
                row[names[family.name]] = int(sample.value)
    for row in figures.values():
        row["saved"] = row.get("before", 0) - row.get("after", 0)
    # A series created but never increased is no request: the page lists none for it either.
    return {labels: row for labels, row in figures.items() if any(row.values())}


def minus(after: Figures, before: Figures) -> Figures:
    return {
        labels: {name: value - before.get(labels, {}).get(name, 0) for name, value in row.items()}
        for labels, row in after.items()
        if row != before.get(labels)
    }
