"""Inline SVG charts: no script, no library, no style attributes (the console's CSP forbids them):
presentation attributes only, every label escaped."""

from __future__ import annotations

from dataclasses import dataclass

from markupsafe import Markup, escape

BEFORE_COLOUR = "#9aa5b1"
AFTER_COLOUR = "#2f6fdb"
_LABEL_W = 220
_BAR_W = 420
_ROW_H = 34


@dataclass(frozen=True)
class PairedBar:
    label: str
    before: float
    after: float


def before_after_chart(bars: list[PairedBar], title: str) -> Markup:
    """One row per label: the grey bar is before, the blue bar after (both to the same scale)."""
    if not bars:
        return Markup("")
    top = max(max(bar.before, bar.after) for bar in bars) or 1.0
    height = _ROW_H * len(bars) + 24
    width = _LABEL_W + _BAR_W + 90
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" class="chart" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}"><title>{escape(title)}</title>'
    ]
    for index, bar in enumerate(bars):
        y = 8 + index * _ROW_H
        before_w = _BAR_W * bar.before / top
        after_w = _BAR_W * bar.after / top
        parts.append(
            f'<text x="0" y="{y + 17}" font-size="12" fill="#1f2933">{escape(bar.label[:34])}</text>'
            f'<rect x="{_LABEL_W}" y="{y}" width="{before_w:.1f}" height="12" fill="{BEFORE_COLOUR}"/>'
            f'<rect x="{_LABEL_W}" y="{y + 13}" width="{after_w:.1f}" height="12" fill="{AFTER_COLOUR}"/>'
            f'<text x="{_LABEL_W + before_w + 6:.1f}" y="{y + 10}" font-size="10" fill="#52606d">'
            f"{bar.before:,.0f}</text>"
            f'<text x="{_LABEL_W + after_w + 6:.1f}" y="{y + 23}" font-size="10" fill="#52606d">'
            f"{bar.after:,.0f}</text>"
        )
    legend_y = height - 6
    parts.append(
        f'<rect x="{_LABEL_W}" y="{legend_y - 9}" width="10" height="10" fill="{BEFORE_COLOUR}"/>'
        f'<text x="{_LABEL_W + 14}" y="{legend_y}" font-size="11" fill="#1f2933">before compression</text>'
        f'<rect x="{_LABEL_W + 150}" y="{legend_y - 9}" width="10" height="10" fill="{AFTER_COLOUR}"/>'
        f'<text x="{_LABEL_W + 164}" y="{legend_y}" font-size="11" fill="#1f2933">sent to the model</text>'
        "</svg>"
    )
    return Markup("".join(parts))


def gauge(fraction: float, label: str) -> Markup:
    """A horizontal bar filled to `fraction` (0..1), e.g. KV cache use."""
    fraction = min(1.0, max(0.0, fraction))
    return Markup(
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" class="gauge" width="260" height="18" '
        f'viewBox="0 0 260 18"><title>{escape(label)}</title>'
        f'<rect x="0" y="2" width="200" height="14" fill="#e4e7eb"/>'
        f'<rect x="0" y="2" width="{200 * fraction:.1f}" height="14" fill="{AFTER_COLOUR}"/>'
        f'<text x="206" y="14" font-size="11" fill="#1f2933">{fraction:.0%}</text></svg>'
    )
