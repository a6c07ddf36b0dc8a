"""The tokenizer each served model is counted with (`model_list[].tokenizer`).

A request's budget is a promise about the prompt the model will read, so it is counted with that
model's tokenizer and chat template; client text is neutralised against that model's special
tokens; the compression pipeline prices passages with the same counts. A model list can put a
Qwen group beside a SmolLM2 one behind one gateway, so these are per served model: resolved where
the request's model is, loaded once at startup (each distinct spec once), a bad spec a startup error
naming the model. Models that name none share the gateway's default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ctxgate.compression.counting import CachedCounter
from ctxgate.gateway.model_list_config import ModelConfig
from ctxgate.gateway.sanitize import KNOWN_CONTROL_TOKENS, Neutraliser
from ctxgate.gateway.tokenizer_spec import load_counting_tokenizer


@dataclass(frozen=True)
class ModelTokens:
    """What a request for one served model is counted, rendered and neutralised with."""

    # `encode`, `render_chat`, `count_chat`, `special_tokens` (ctxgate.backend.model.tokenizer.Tokenizer, TiktokenTokenizer).
    tokenizer: Any
    neutraliser: Neutraliser
    # The compression pipeline's counter for this model; None: the pipeline's own (the default tokenizer's).
    counter: CachedCounter | None = None


class ModelTokenizers:
    """Served model name → its `ModelTokens`; names without their own get the default."""

    def __init__(self, default: ModelTokens, by_model: dict[str, ModelTokens] | None = None) -> None:
        self.default = default
        self.by_model = dict(by_model or {})

    def for_model(self, model: str | None) -> ModelTokens:
        return self.by_model.get(model or "", self.default)


def load_model_tokenizers(
    default_tokenizer: Any, forwards_fields: bool, models: list[ModelConfig]
) -> ModelTokenizers:
    """`default_tokenizer` (the gateway's), and each model's own. `forwards_fields`: some model is an HTTP
    upstream, whose chat template the gateway does not see: the common templates' control tokens are
    neutralised too (a model with its own tokenizer is always an upstream)."""
    extra = KNOWN_CONTROL_TOKENS if forwards_fields else ()
    default = ModelTokens(default_tokenizer, Neutraliser(default_tokenizer, extra=extra))
    loaded: dict[str, ModelTokens] = {}
    by_model = {}
    for model in models:
        if model.tokenizer is None:
            continue
        if model.tokenizer not in loaded:
            loaded[model.tokenizer] = _load(model.model_name, model.tokenizer)
        by_model[model.model_name] = loaded[model.tokenizer]
    return ModelTokenizers(default, by_model)


def _load(model_name: str, spec: str) -> ModelTokens:
    try:
        tokenizer = load_counting_tokenizer(spec)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"model_list: model '{model_name}': tokenizer {spec!r} could not be loaded: {exc}"
        ) from exc
    return ModelTokens(
        tokenizer, Neutraliser(tokenizer, extra=KNOWN_CONTROL_TOKENS), CachedCounter(tokenizer)
    )
