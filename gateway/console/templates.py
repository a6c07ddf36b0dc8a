"""The console's Jinja2 templates (autoescaped, strict about undefined names) and their filters."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from starlette.responses import HTMLResponse

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"


def _when(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {secs}s" if minutes else f"{secs}s"


def _number(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.4g}"


def _millis(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1000:.1f} ms"


class Templates:
    def __init__(self) -> None:
        self.env = Environment(
            loader=FileSystemLoader(TEMPLATE_DIR),
            autoescape=select_autoescape(("html",), default=True),
            undefined=StrictUndefined,
        )
        self.env.filters.update(when=_when, duration=_duration, number=_number, millis=_millis)

    def render(self, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        context.setdefault("session", None)
        context.setdefault("active", "")
        return HTMLResponse(self.env.get_template(name).render(**context), status_code=status)
