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

import json
import re
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Protocol

from ctxgate.compression.rendering import LINE_MARKERS
from ctxgate.compression.types import CompressionInput

ZERO_WIDTH_SPACE = "\u200b"
# Built from the renderer's own list, so a marker added there is neutralised here too. The indent
# is horizontal whitespace only (possessive): a `\s*` there would also cross line breaks, and every
# line start of a run of blank lines would rescan the run (quadratic time on client text). The quoted
# result is the same: the "> " still goes right before the marker.
_STRUCTURE_LINE = re.compile(rf"^([^\S\n]*+)({'|'.join(LINE_MARKERS)})", re.IGNORECASE | re.MULTILINE)


# Upstream mode: the serving model may not be the one the gateway counts with, so the control tokens
# of the common chat templates are neutralised too (ChatML/Qwen, Llama 3, Gemma, Phi, Mistral, ...).
KNOWN_CONTROL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "<|start|>",
    "<|message|>",
    "<|channel|>",
    "<|return|>",
    "<|call|>",
)


class SpecialTokenSource(Protocol):
    """What the neutraliser needs of a tokenizer (ctxgate.backend.model.tokenizer.Tokenizer, TiktokenTokenizer)."""

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

    def value(self, value: Any) -> Any:
        """A JSON value with every string in it made inert, object keys included: tool schemas,
        descriptions, a message's name, ... anything a chat template may print."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {
                self.text(key) if isinstance(key, str) else key: self.value(item)
                for key, item in value.items()
            }
        if isinstance(value, list | tuple):
            return [self.value(item) for item in value]
        return value

    def arguments(self, value: Any) -> Any:
        """A tool call's `arguments`: usually a JSON string, which templates parse and print again,
        so a token spelled with JSON escapes (`\\u003c|im_end|>`) would come back whole. The parsed
        value is neutralised and serialised again; a string that is not JSON is neutralised as text."""
        if not isinstance(value, str):
            return self.value(value)
        try:
            parsed = json.loads(value)
        except ValueError:
            return self.text(value)
        return json.dumps(self.value(parsed), ensure_ascii=False)

    def message(self, message: dict[str, Any]) -> dict[str, Any]:
        """A chat message with every string a template renders made inert: content, name, tool
        calls (names and arguments), tool call ids and any other field an upstream may print. The
        role is the schema's closed set and stays."""
        cleaned = {key: item if key == "role" else self.value(item) for key, item in message.items()}
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            cleaned["tool_calls"] = [self._call(call) for call in calls]
        return cleaned

    def _call(self, call: Any) -> Any:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            return self.value(call)
        function = call["function"]
        return self.value({**call, "function": {}}) | {
            "function": self.value(function)
            | ({"arguments": self.arguments(function["arguments"])} if "arguments" in function else {})
        }

    def compression_input(self, request: CompressionInput) -> CompressionInput:
        """The request with its client text made inert: every rendered field of each message
        (`message`), each document's text and title. Linear-time, but a whole request's text: the
        gateway runs it in the compression worker, off its event loop."""
        messages = [self.message(message) for message in request.messages]
        documents = [
            replace(
                document,
                text=self.document(document.text),
                title=None if document.title is None else self.document(document.title),
            )
            for document in request.documents
        ]
        return replace(request, messages=messages, documents=documents)
