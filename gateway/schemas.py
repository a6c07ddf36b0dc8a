"""The gateway's request bodies: the shared OpenAI ones (`backend.openai_api.schemas`) plus ctxgate's extras."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from backend.openai_api import schemas as openai


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CtxgateDocument(_Strict):
    text: str
    id: str | int | None = None
    title: str | None = None
    score: float | None = None


class CtxgateRetrieval(_Strict):
    index: str = Field(..., min_length=1)
    top_n: int = Field(5, ge=1, le=100)


class CtxgateExtras(_Strict):
    documents: list[CtxgateDocument] | None = None
    retrieval: CtxgateRetrieval | None = None
    policy: str | None = Field(None, min_length=1)
    priority: Literal["user", "background"] | None = None
    overrides: dict[str, Any] | None = Field(
        None, description="dotted policy fields to override, only those the policy allows"
    )


class _GatewayFields(BaseModel):
    # The gateway picks the policy budget by model, so the model is required (as in OpenAI's API).
    model: str = Field(..., min_length=1)
    ctxgate: CtxgateExtras | None = None


class ChatCompletionRequest(_GatewayFields, openai.ChatCompletionRequest):
    pass


class CompletionRequest(_GatewayFields, openai.CompletionRequest):
    # Text only: the budget and the sanitiser work on text, never on client-chosen token ids.
    prompt: str | list[str]


GatewayRequest = ChatCompletionRequest | CompletionRequest
