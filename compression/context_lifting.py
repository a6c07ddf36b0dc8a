"""Retrieved context that RAG frameworks render inside the messages, found and lifted out as passages.

LangChain's stuff-documents prompt, LlamaIndex's context chat and most hand-written RAG prompts put
the retrieved passages into the system or user message instead of ctxgate's `documents` field. This
module finds such blocks (every one of them: context in the system message and more in the user
message, or two "Context:" sections, are all lifted), splits them into passages and records where
each was, so the same stages (dedup, rerank, extraction, assembly) cut them and the renderer puts
what is kept of each block back in its place. The text around the blocks (the instructions, the
question) is never touched.

Layouts recognised, tried in this order on each system message and then on the question:

- XML-ish tags: `<document>`/`<doc id=..>`/`<passage>`/`<source>` elements (each one a passage), or a
  `<context>`/`<documents>`/`<sources>` container whose content is split as below;
- LlamaIndex's dashed block: "Context information is below.\\n-----\\n{context_str}\\n-----";
- numbered documents: "Document [1](Title: ...)", "[1] ...", "Source 1:", "Passage 2:" (two or more);
- a "Context:" section (also "Documents:", "Sources:", "Retrieved context:", ...), up to a
  "Question:"/"Query:"/"Answer:" line, a final question, or the end of the message;
- system messages only: the instructions paragraph followed by blank-line separated passages, as
  LangChain's stuff-documents prompt renders "{instructions}\\n\\n{context}".

A block's content is split into passages by the numbered headers when it has them, else by blank
lines (a paragraph of "key: value" metadata lines, as LlamaIndex renders node metadata, stays with
the paragraph after it). Each passage keeps its own markup (header, tags) verbatim as its `frame`.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass

from ctxgate.compression.counting import CachedCounter
from ctxgate.compression.state import ContextSlot, Passage, PipelineState, message_text
from ctxgate.compression.types import Document, StageReport

# Below this many characters a block is not worth lifting (and is likely not retrieved context).
MIN_BLOCK_CHARS = 80
# The bare blank-line layout needs this much passage text: short instruction paragraphs never qualify.
MIN_BARE_PASSAGES = 2
MIN_BARE_CHARS = 400

_ELEMENT_TAGS = "document|doc|passage|source|search_result|result"
_CONTAINER_TAGS = "context|contexts|documents|docs|sources|search_results|retrieved_context|knowledge"
# What an element is; found through `_Elements` (a lazy `.*?` body with no closing tag scans to the end
# of the text from every opening tag, quadratic time on client text), and matched with these only
# between an opening tag and the closing tag `_Elements` found for it.
_ELEMENT = re.compile(
    rf"<(?P<tag>{_ELEMENT_TAGS})\b(?P<attrs>[^>]*)>(?P<body>.*?)</(?P=tag)\s*>",
    re.IGNORECASE | re.DOTALL,
)
_CONTAINER = re.compile(
    rf"<(?P<tag>{_CONTAINER_TAGS})\b[^>]*>(?P<body>.*?)</(?P=tag)\s*>",
    re.IGNORECASE | re.DOTALL,
)
# Possessive and anchored at a word's start: an attribute name cannot start inside a word (the
# word's own start would have matched first), and none of the value forms starts with whitespace.
_ATTRIBUTE = re.compile(r"""(?<!\w)(\w++)\s*+=\s*+(?:"([^"]*)"|'([^']*)'|([^\s>]+))""")
_DASHES = re.compile(r"^[ \t]*-{3,}[ \t]*$", re.MULTILINE)
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
_SECTION = re.compile(
    r"^[ \t]*+(?:#++[ \t]*+)?(?:context|contexts|context information|retrieved context|relevant context|documents|"
    r"retrieved documents|sources|references|search results|background|knowledge)[ \t]*+(?::[ \t]*+)?$"
    r"|^[ \t]*+(?:context|contexts|retrieved context|documents|sources)[ \t]*+:[ \t]*+(?=\S)",
    re.MULTILINE | re.IGNORECASE,
)
_TERMINATOR = re.compile(
    r"^[ \t]*+(?:#++[ \t]*+)?(?:(?:question|query|user question|q|answer|instructions?|task|helpful answer)[ \t]*+:"
    r"|given the context\b)",
    re.MULTILINE | re.IGNORECASE,
)
# A message holds a few context blocks at most; each search for one reads the rest of the message,
# so the search stops after this many (what follows is left as it is).
MAX_BLOCKS = 16
# A paragraph's first line this short, without sentence punctuation, is its title.
MAX_TITLE_CHARS = 80
_METADATA_LINE = re.compile(r"^[\w .-]{1,40}:[ \t]+\S.{0,200}$")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")

_SPACE_RUN = re.compile(r"\s*")


def _fold(tag: str) -> str:
    """A tag name as `(?P=tag)` compares it under IGNORECASE: character by character, by simple
    lower case (only U+0130's full lower case, "i" + a combining dot, is longer than one character)."""
    return tag.replace("\u0130", "i").lower()


class _Elements:
    """The matches `pattern.finditer` returns (an opening tag, a lazy body, the same tag closing),
    found in time linear in the text: every closing tag is listed once, so an opening tag with no
    closing tag after it costs a lookup instead of a scan to the end of the text."""

    def __init__(self, tags: str, pattern: re.Pattern[str]):
        self._open = re.compile(rf"<({tags})\b", re.IGNORECASE)
        self._close = re.compile(rf"</({tags})\s*+>", re.IGNORECASE)
        self._pattern = pattern

    def finditer(self, text: str) -> Iterator[re.Match[str]]:
        closings: dict[str, tuple[list[int], list[int]]] | None = None
        position = 0
        tag_end = -1  # the first ">" at or after the last opening tag's name
        while (opening := self._open.search(text, position)) is not None:
            if tag_end < opening.end():
                tag_end = text.find(">", opening.end())
                if tag_end < 0:
                    return  # no opening tag can end
            if closings is None:
                closings = self._closings(text)
            starts, ends = closings.get(_fold(opening.group(1)), ((), ()))
            index = bisect_left(starts, tag_end + 1)
            if index == len(starts):
                position = opening.start() + 1
                continue
            # The lazy body stops at the first closing tag of the same name: the pattern, matched
            # up to there, is the whole match (and reads only the element itself).
            match = self._pattern.match(text, opening.start(), ends[index])
            if match is None:
                position = opening.start() + 1
                continue
            yield match
            position = match.end()

    def search(self, text: str) -> re.Match[str] | None:
        return next(self.finditer(text), None)

    def _closings(self, text: str) -> dict[str, tuple[list[int], list[int]]]:
        found: dict[str, tuple[list[int], list[int]]] = {}
        for closing in self._close.finditer(text):
            starts, ends = found.setdefault(_fold(closing.group(1)), ([], []))
            starts.append(closing.start())
            ends.append(closing.end())
        return found


_ELEMENTS = _Elements(_ELEMENT_TAGS, _ELEMENT)
_CONTAINERS = _Elements(_CONTAINER_TAGS, _CONTAINER)


@dataclass
class FoundPassage:
    body: str  # what the stages score and cut
    frame: tuple[str, str]  # markup kept verbatim before and after the body
    title: str | None = None
    id: str | None = None


@dataclass
class FoundContext:
    layout: str
    start: int  # the block is text[start:end]; everything outside it is kept as it is
    end: int
    passages: list[FoundPassage]


# -- detection -------------------------------------------------------------------------------------
def find_context(text: str, system: bool) -> FoundContext | None:
    """The retrieved-context block in one message's text, or None (the text is then left alone)."""
    for detect in (_tagged, _dashed, _numbered_block, _section):
        found = detect(text)
        if found is not None and found.passages and found.end - found.start >= MIN_BLOCK_CHARS:
            return found
    if system:
        return _bare_paragraphs(text)
    return None


def _tagged(text: str) -> FoundContext | None:
    elements = _ELEMENTS.finditer(text)
    first = next(elements, None)
    if first is not None:
        # One block is a run of elements with only whitespace between them: text between two runs
        # (an instruction, a second container's tags) is not context; the next search finds the next run.
        run = [first]
        for element in elements:
            if text[run[-1].end() : element.start()].strip():
                break
            run.append(element)
        passages = [_element_passage(match) for match in run]
        return FoundContext("tagged", run[0].start(), run[-1].end(), passages)
    container = _CONTAINERS.search(text)
    if container is None:
        return None
    start, end = container.span("body")
    return FoundContext("tagged", start, end, split_passages(text[start:end]))


def _element_passage(match: re.Match[str]) -> FoundPassage:
    body = match.group("body")
    attrs = {
        m.group(1).lower(): m.group(2) or m.group(3) or m.group(4) or ""
        for m in _ATTRIBUTE.finditer(match.group("attrs"))
    }
    stripped = body.strip()
    lead = body[: len(body) - len(body.lstrip())]
    trail = body[len(body.rstrip()) :]
    open_tag = match.group(0)[: match.start("body") - match.start()]
    close_tag = match.group(0)[match.end("body") - match.start() :]
    return FoundPassage(
        stripped,
        (open_tag + lead, trail + close_tag),
        title=attrs.get("title"),
        id=attrs.get("id") or attrs.get("index"),
    )


def _dashed(text: str) -> FoundContext | None:
    lines = list(_DASHES.finditer(text))
    if len(lines) < 2:
        return None
    start, end = lines[0].end(), lines[1].start()
    start += len(text[start:end]) - len(text[start:end].lstrip("\n"))
    return FoundContext("dashed", start, end, split_passages(text[start:end]))


def _numbered_block(text: str) -> FoundContext | None:
    headers = _numbered_headers(text)
    if headers is None:
        return None
    start = headers[0].start()
    end = _block_end(text, headers[-1].end())
    return FoundContext("numbered", start, end, _numbered_passages(text[start:end]))


def _section(text: str) -> FoundContext | None:
    header = _SECTION.search(text)
    if header is None:
        return None
    start = header.end()
    start += len(text[start:]) - len(text[start:].lstrip())
    end = _block_end(text, start)
    if end <= start:
        return None
    return FoundContext("section", start, end, split_passages(text[start:end]))


def _bare_paragraphs(text: str) -> FoundContext | None:
    breaks = list(_PARAGRAPH_BREAK.finditer(text))
    if len(breaks) < MIN_BARE_PASSAGES:
        return None
    start = breaks[0].end()  # the first paragraph is the instructions
    block = text[start:].rstrip()
    passages = split_passages(block)
    if len(passages) < MIN_BARE_PASSAGES or len(block) < MIN_BARE_CHARS or len(block) < 2 * start:
        return None
    return FoundContext("paragraphs", start, start + len(block), passages)


def _block_end(text: str, from_index: int) -> int:
    """Where a block starting before `from_index` ends: at a "Question:"-style line or the next
    "Context:"-style section (a block of its own), before a final paragraph that asks a question, or
    at the end of the text (trailing whitespace excluded)."""
    terminators = [
        match
        for match in (_TERMINATOR.search(text, from_index), _SECTION.search(text, from_index))
        if match is not None
    ]
    terminator = min(terminators, key=lambda match: match.start()) if terminators else None
    end = terminator.start() if terminator else len(text)
    paragraphs = list(_PARAGRAPH_BREAK.finditer(text, from_index, end))
    if terminator is None and paragraphs:
        last = text[paragraphs[-1].end() : end].strip()
        if last.endswith("?") and len(last) < 400:  # the question itself closes the message
            end = paragraphs[-1].start()
    return from_index + len(text[from_index:end].rstrip())


# -- splitting a block into passages -------------------------------------------------------------
def split_passages(block: str) -> list[FoundPassage]:
    """Passages of a block: by numbered headers when it has two or more, else by blank lines."""
    if _numbered_headers(block) is not None:
        return _numbered_passages(block)
    passages: list[FoundPassage] = []
    metadata = ""
    for paragraph in _PARAGRAPH_BREAK.split(block):
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


def _numbered_headers(text: str) -> list[re.Match[str]] | None:
    """The headers of the first numbering style that occurs at least twice, in order."""
    for style in _NUMBERED_STYLES:
        matches = list(style.finditer(text))
        if len(matches) >= 2:
            return matches
    return None


def _numbered_passages(block: str) -> list[FoundPassage]:
    headers = _numbered_headers(block) or []
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


# -- lifting the blocks out of the request -------------------------------------------------------
def find_contexts(text: str, system: bool) -> list[FoundContext]:
    """Every retrieved-context block in one message's text, in order (several "Context:" sections,
    separate tagged containers...): after each block, the rest of the text is searched again."""
    blocks: list[FoundContext] = []
    position = 0
    while position < len(text) and len(blocks) < MAX_BLOCKS:
        # The bare-paragraphs layout (instructions, then passages) only describes a whole message.
        found = find_context(text[position:], system=system and not blocks)
        if found is None:
            break
        found.start += position
        found.end += position
        blocks.append(found)
        position = found.end
    return blocks


def lift_context(state: PipelineState) -> list[tuple[str, FoundContext]]:
    """Find every block (system messages first, then the question), take them out of their
    messages, record the slot each goes back into and add their passages to `state.passages`."""
    candidates = [("system", i, m) for i, m in enumerate(state.system_messages)] + [
        ("question", 0, state.question)
    ]
    lifted_blocks: list[tuple[str, FoundContext]] = []
    for where, index, message in candidates:
        if not isinstance(message.get("content"), str):
            continue  # content parts: left as sent
        text = message_text(message)
        blocks = find_contexts(text, system=where == "system")
        if not blocks:
            continue
        kept_text, removed = [], 0
        previous_end = 0
        for found in blocks:
            kept_text.append(text[previous_end : found.start])
            # The offset is into the message with every block removed.
            offset = found.start - removed
            removed += found.end - found.start
            previous_end = found.end
            slot = len(state.context_slots)
            state.context_slots.append(
                ContextSlot(where=where, index=index, offset=offset, layout=found.layout)
            )
            first = len(state.passages)
            for number, passage in enumerate(found.passages):
                document = Document(text=passage.body, id=passage.id, title=passage.title)
                state.passages.append(
                    Passage(document=document, position=first + number, frame=passage.frame, slot=slot)
                )
            lifted_blocks.append(((f"{where}[{index}]" if where == "system" else "question"), found))
        kept_text.append(text[previous_end:])
        lifted = dict(message)
        lifted["content"] = "".join(kept_text)
        if where == "system":
            state.system_messages[index] = lifted
        else:
            state.question = lifted
    return lifted_blocks


def report_kept(state: PipelineState, reports: list[StageReport], counter: CachedCounter) -> None:
    """Complete the message-context report with what of the found passages is sent."""
    report = next((r for r in reports if r.name == "message-context"), None)
    if report is None or not report.details.get("passages_found"):
        return
    kept = [p.body() for p in state.passages if p.frame is not None and not p.is_empty()]
    report.details["passages_kept"] = len(kept)
    report.details["tokens_kept"] = sum(counter.count_many(kept))
    report.details["tokens_cut"] = report.details["tokens_found"] - report.details["tokens_kept"]
