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
the paragraph after it). Each passage keeps its own markup (header, tags) verbatim as its `frame`
(splitting: compression/context_passages.py; tagged elements: compression/context_tags.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ctxgate.compression.context_passages import (
    PARAGRAPH_BREAK,
    FoundPassage,
    numbered_headers,
    numbered_passages,
    split_passages,
)
from ctxgate.compression.context_tags import CONTAINERS, ELEMENTS, element_passage
from ctxgate.compression.counting import CachedCounter
from ctxgate.compression.state import ContextSlot, Passage, PipelineState, message_text
from ctxgate.compression.types import Document, StageReport

# Below this many characters a block is not worth lifting (and is likely not retrieved context).
MIN_BLOCK_CHARS = 80
# The bare blank-line layout needs this much passage text: short instruction paragraphs never qualify.
MIN_BARE_PASSAGES = 2
MIN_BARE_CHARS = 400

_DASHES = re.compile(r"^[ \t]*-{3,}[ \t]*$", re.MULTILINE)
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
# The layouts are searched line by line (a few microseconds a line), so a message of more lines than
# this is not searched: a megabyte of newlines would hold the GIL for seconds of every other tenant's
# time. Retrieved context that long belongs in `ctxgate.documents`, which is split without searching.
MAX_SEARCHED_LINES = 20_000


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
    elements = ELEMENTS.finditer(text)
    first = next(elements, None)
    if first is not None:
        # One block is a run of elements with only whitespace between them: text between two runs
        # (an instruction, a second container's tags) is not context; the next search finds the next run.
        run = [first]
        for element in elements:
            if text[run[-1].end() : element.start()].strip():
                break
            run.append(element)
        passages = [element_passage(match) for match in run]
        return FoundContext("tagged", run[0].start(), run[-1].end(), passages)
    container = CONTAINERS.search(text)
    if container is None:
        return None
    start, end = container.span("body")
    return FoundContext("tagged", start, end, split_passages(text[start:end]))


def _dashed(text: str) -> FoundContext | None:
    lines = list(_DASHES.finditer(text))
    if len(lines) < 2:
        return None
    start, end = lines[0].end(), lines[1].start()
    start += len(text[start:end]) - len(text[start:end].lstrip("\n"))
    return FoundContext("dashed", start, end, split_passages(text[start:end]))


def _numbered_block(text: str) -> FoundContext | None:
    headers = numbered_headers(text)
    if headers is None:
        return None
    start = headers[0].start()
    end = _block_end(text, headers[-1].end())
    return FoundContext("numbered", start, end, numbered_passages(text[start:end]))


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
    breaks = list(PARAGRAPH_BREAK.finditer(text))
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
    paragraphs = list(PARAGRAPH_BREAK.finditer(text, from_index, end))
    if terminator is None and paragraphs:
        last = text[paragraphs[-1].end() : end].strip()
        if last.endswith("?") and len(last) < 400:  # the question itself closes the message
            end = paragraphs[-1].start()
    return from_index + len(text[from_index:end].rstrip())


# -- lifting the blocks out of the request -------------------------------------------------------
def find_contexts(text: str, system: bool) -> list[FoundContext]:
    """Every retrieved-context block in one message's text, in order (several "Context:" sections,
    separate tagged containers...): after each block, the rest of the text is searched again. None in
    a text of more than `MAX_SEARCHED_LINES` lines."""
    blocks: list[FoundContext] = []
    if text.count("\n", 0, len(text)) > MAX_SEARCHED_LINES:
        return blocks
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
