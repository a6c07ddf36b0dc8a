"""Log probabilities in OpenAI's two shapes: chat's `{"content": [{token, logprob, bytes,
top_logprobs}]}` and completions' `{tokens, token_logprobs, top_logprobs, text_offset}`."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ctxgate.backend.engine.api import TokenLogprob
from ctxgate.backend.model.tokenizer import Tokenizer


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's byte-level BPE alphabet: each byte is spelled by one printable unicode character.
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for (a piece of a UTF-8 character stays a piece)."""
    piece = tokenizer.id_to_piece(token_id)
    decoder = _byte_decoder()
    if piece and all(char in decoder for char in piece):
        return bytes(decoder[char] for char in piece)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(tokenizer, token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprob], text_offset: int = 0
) -> dict[str, Any]:
    tokens = [token_text(tokenizer, e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }
