"""README.md is the front door: the two commands and a working request on its first screen, short,
and every link into docs/ points at a page that exists (the docs site checks its own links)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
FIRST_SCREEN_LINES = 30


def test_the_first_screen_has_the_two_commands_and_a_request():
    first_screen = "\n".join(README.splitlines()[:FIRST_SCREEN_LINES])
    assert "make serve" in first_screen and "make test" in first_screen
    assert "curl" in first_screen and "/v1/chat/completions" in first_screen


def test_the_readme_stays_short():
    assert len(README.splitlines()) < 150


def test_every_docs_link_resolves():
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", README)
    assert len(links) > 10
    assert [link for link in links if not (REPO / link).is_file()] == []
