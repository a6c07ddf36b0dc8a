"""A block of retrieved context split into passages: by its numbered headers ("Document [1](Title:
...)", "[1] ...", "Source 1:") when it has two or more, else by blank lines (a paragraph of
"key: value" metadata lines, as LlamaIndex renders node metadata, stays with the paragraph after
it). Each passage keeps its own markup (header, tags) verbatim as its `frame`
(compression/context_lifting.py finds the blocks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Numbered passage headers at the start of a line; the rest of the header line is `rest`. Runs of
# blanks are possessive: two optional runs side by side would split one run every possible way.
_NUMBERED_STYLES = (
    re.compile(
        r"^[ \t]*+Document[ \t]*+\[(?P<n>\d++)\](?:[ \t]*+\(Title:[ \t]*+(?P<title>[^\n]*?)\))?[ \t]*+"
        r"(?P<rest>[^\n]*)",
        re.MULTILINE | re.IGNORECASE,
    ),
    re.compile(
        r"^[ \t]*+(?:Document|Source|Passage|Doc|Context|Chunk|Excerpt)[ \t]*+(?:#[ \t]*+)?(?P<n>\d++)[ \t]*+"
        r"[:.)\-][ \t]*+(?P<rest>[^\n]*)",
        re.MULTILINE | re.IGNORECASE,
    ),
    re.compile(r"^[ \t]*+\[(?P<n>\d++)\][ \t]*+(?P<rest>[^\n]*)", re.MULTILINE),
)
# A paragraph's first line this short, without sentence punctuation, is its title.
MAX_TITLE_CHARS = 80
_METADATA_LINE = re.compile(r"^[\w .-]{1,40}:[ \t]+\S.{0,200}$")
PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")

_SPACE_RUN = re.compile(r"\s*")


@dataclass
class FoundPassage:
    body: str  # what the stages score and cut
    frame: tuple[str, str]  # markup kept verbatim before and after the body
    title: str | None = None
    id: str | None = None


def split_passages(block: str) -> list[FoundPassage]:
    """Passages of a block: by numbered headers when it has two or more, else by blank lines."""
    if numbered_headers(block) is not None:
        return numbered_passages(block)
    passages: list[FoundPassage] = []
    metadata = ""
    for paragraph in PARAGRAPH_BREAK.split(block):
        if not paragraph.strip():
            continue
        lines = [line for line in paragraph.strip().splitlines() if line.strip()]
        if all(_METADATA_LINE.match(line.strip()) for line in lines) and len(lines) <= 6:
            metadata += paragraph.strip() + "\n\n"  # LlamaIndex node metadata: belongs to the next text
            continue
        head, body, title = _peel_title(lines)
        frame_head = metadata + head
        passages.append(
            FoundPassage(
                body if head else paragraph.strip(), (frame_head, ""), title=title or _title_from(metadata)
            )
        )
        metadata = ""
    return passages


def _peel_title(lines: list[str]) -> tuple[str, str, str | None]:
    """(header kept verbatim, body, title) of a paragraph whose first line names it: "Title: X" or a
    short line without sentence punctuation ("{title}\n{page_content}" document prompts)."""
    if len(lines) < 2:
        return "", "\n".join(lines), None
    first = lines[0].strip()
    key, _, value = first.partition(":")
    if value.strip() and key.strip().lower() in ("title", "source", "document", "file_name", "file_path"):
        return lines[0] + "\n", "\n".join(lines[1:]).strip(), value.strip()
    if len(first) <= MAX_TITLE_CHARS and not first.endswith((".", "!", "?", ":", ";", ",")):
        return lines[0] + "\n", "\n".join(lines[1:]).strip(), first
    return "", "\n".join(lines), None


def _title_from(metadata: str) -> str | None:
    for line in metadata.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("title", "file_name", "source", "file_path") and value.strip():
            return value.strip()
    return None


def numbered_headers(text: str) -> list[re.Match[str]] | None:
    """The headers of the first numbering style that occurs at least twice, in order."""
    for style in _NUMBERED_STYLES:
        matches = list(style.finditer(text))
        if len(matches) >= 2:
            return matches
    return None


def numbered_passages(block: str) -> list[FoundPassage]:
    headers = numbered_headers(block) or []
    passages = []
    for index, header in enumerate(headers):
        end = headers[index + 1].start() if index + 1 < len(headers) else len(block)
        content = block[header.end() : end]
        rest = header.group("rest").strip()
        title = header.groupdict().get("title")
        if rest and content.strip() and title is None:
            # "[1] Title\nbody": the rest of the header line names the passage; it stays in the frame.
            frame_end, body, title = header.end(), content.strip(), rest
        else:
            frame_end, body = header.start("rest"), (rest + content).strip()
        passages.append(
            FoundPassage(
                body,
                (block[header.start() : frame_end] + _gap(block, frame_end, body), ""),
                title=title,
                id=header.group("n"),
            )
        )
    return [passage for passage in passages if passage.body]


def _gap(block: str, frame_end: int, body: str) -> str:
    """The whitespace between a header and its body (kept so the rendering matches the original)."""
    # Matched, not sliced off the rest of the block: a block of many headers stays linear.
    return _SPACE_RUN.match(block, frame_end).group() if body else ""
