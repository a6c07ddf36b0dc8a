"""Neutralise client text that could forge prompt structure.

The prompt is rendered as text and then tokenized, so a document (or message) containing a
control-token string such as `<|im_end|>` would become a real control token and let retrieved text
close its turn and open a `system` turn. Every special-token string of the model's tokenizer is
broken with a zero-width space, which the tokenizer then reads as ordinary text. Documents also
cannot fake the context block's own markers (the renderer's `LINE_MARKERS`: "Documents:",
"Question:", "[n]" passage headers, ...) at the start of a line: such lines are quoted so the real
question stays the only one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace
from typing import Protocol

from compression.rendering import LINE_MARKERS
from compression.types import CompressionInput

ZERO_WIDTH_SPACE = "\u200b"
# Built from the renderer's own list, so a marker added there is neutralised here too. The indent
# is horizontal whitespace only (possessive): a `\s*` there would also cross line breaks, and every
# line start of a run of blank lines would rescan the run (quadratic time on client text). The quoted
# result is the same: the "> " still goes right before the marker.
_STRUCTURE_LINE = re.compile(rf"^([^\S\n]*+)({'|'.join(LINE_MARKERS)})", re.IGNORECASE | re.MULTILINE)


# Upstream mode: the serving model may not be the one the gateway counts with, so the control tokens
# of the common chat templates are neutralised too (ChatML/Qwen, Llama 3, Gemma, Phi, Mistral, ...).
KNOWN_CONTROL_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
    "<start_of_turn>", "<end_of_turn>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
    "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<|start|>", "<|message|>", "<|channel|>",
    "<|return|>", "<|call|>",
)


class SpecialTokenSource(Protocol):
    """What the neutraliser needs of a tokenizer (backend.tokenizer.Tokenizer, TiktokenTokenizer)."""

    def special_tokens(self) -> set[str]: ...


class Neutraliser:
    def __init__(self, tokenizer: SpecialTokenSource | None, extra: Iterable[str] = ()):
        """`tokenizer`: the special tokens of the model the prompt is for (None: none); `extra`: more
        strings to break (upstream mode: KNOWN_CONTROL_TOKENS)."""
        specials = set(tokenizer.special_tokens()) if tokenizer is not None else set()
        specials.update(extra)
        # Longest first so a token that contains another is broken as a whole.
        self.special_tokens = sorted((s for s in specials if len(s) > 1), key=len, reverse=True)

    def text(self, value: str) -> str:
        """Client text with every special-token string made inert."""
        for token in self.special_tokens:
            if token in value:
                value = value.replace(token, token[0] + ZERO_WIDTH_SPACE + token[1:])
        return value

    def document(self, value: str) -> str:
        """A passage: inert special tokens, and no line that mimics the context block's markers."""
        return _STRUCTURE_LINE.sub(lambda m: f"{m.group(1)}> {m.group(2)}", self.text(value))

    def compression_input(self, request: CompressionInput) -> CompressionInput:
        """The request with its client text made inert: each message's (string) content, each
        document's text and title. Linear-time, but a whole request's text: the gateway runs it in
        the compression worker, off its event loop."""
        messages = [message | {"content": self.text(message["content"])} if isinstance(message.get("content"), str)
                    else message for message in request.messages]
        documents = [replace(document, text=self.document(document.text),
                             title=None if document.title is None else self.document(document.title))
                     for document in request.documents]
        return replace(request, messages=messages, documents=documents)
