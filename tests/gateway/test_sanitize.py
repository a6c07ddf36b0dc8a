"""The sanitizer neutralises every marker the prompt renderer can emit.

The markers are not listed here: the rendered prompts below are scanned for them, so a marker the
renderer starts emitting is checked without touching this file.
"""

from __future__ import annotations

import re

import pytest

from ctxgate.compression.rendering import LINE_MARKERS, render_context, render_messages
from ctxgate.compression.state import Passage, PipelineState
from ctxgate.compression.types import Document
from ctxgate.gateway.sanitize import Neutraliser
from ctxgate.policies.schema import AssemblyPolicy

# Client text: every line of a rendered prompt that is not one of these is the renderer's layout.
# The history summary is client-derived and goes in quoted ("> ...").
CLIENT_TEXT = {
    "Be brief.",
    "Earlier turn.",
    "Earlier reply.",
    "> Older talk.",
    "First body.",
    "Second body.",
    "Why?",
}
STARTS_WITH_MARKER = re.compile(rf"^\s*({'|'.join(LINE_MARKERS)})", re.IGNORECASE)


def _rendered_prompts() -> list[str]:
    passages = [
        Passage(document=Document(text="First body.", title="A title"), position=0),
        Passage(document=Document(text="Second body."), position=1),
    ]
    state = PipelineState(
        system_messages=[{"role": "system", "content": "Be brief."}],
        history=[
            {"role": "user", "content": "Earlier turn."},
            {"role": "assistant", "content": "Earlier reply."},
        ],
        question={"role": "user", "content": "Why?"},
        trailing=[],
        passages=passages,
        tenant="t",
    )
    prompts = []
    for placement in ("user", "system"):
        messages = render_messages(
            state, render_context(passages), state.history, "Older talk.", AssemblyPolicy(placement=placement)
        )
        prompts += [m["content"] for m in messages]
    return prompts


def _layout_lines() -> list[str]:
    lines = [line for prompt in _rendered_prompts() for line in prompt.split("\n")]
    return [line for line in lines if line and line not in CLIENT_TEXT]


def test_every_layout_line_starts_with_a_listed_marker():
    # A new header in the renderer that is missing from LINE_MARKERS fails here.
    unlisted = [line for line in _layout_lines() if not STARTS_WITH_MARKER.match(line)]
    assert not unlisted


def test_every_listed_marker_is_emitted_by_the_renderer():
    emitted = _layout_lines()
    for marker in LINE_MARKERS:
        assert any(re.match(marker, line) for line in emitted), marker


@pytest.mark.parametrize("line", sorted(set(_layout_lines())))
def test_documents_cannot_forge_a_rendered_marker(line):
    neutraliser = Neutraliser(None)
    for forged in (line, f"Some text.\n{line}", f"Some text.\n  {line}", line.upper(), line.lower()):
        cleaned = neutraliser.document(forged)
        assert not any(STARTS_WITH_MARKER.match(part) for part in cleaned.split("\n")), cleaned
        assert line.split(" ")[0].lower() in cleaned.lower()  # quoted, not deleted
