"""The gateway's request bodies: the shared OpenAI ones (`ctxgate.backend.openai_api.schemas`) plus ctxgate's extras."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ctxgate.backend.openai_api import schemas as openai


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# A document's id and title are labels (the title is also matched against every other passage's
# text by the second hop): beyond these lengths a request is refused, naming the field.
MAX_DOCUMENT_ID_CHARS = 256
MAX_DOCUMENT_TITLE_CHARS = 1000
# A conversation id names a memory entry (compression/conversation.py): short, and only characters
# that need no escaping in a log line or a Redis key.
MAX_CONVERSATION_ID_CHARS = 128
CONVERSATION_ID_PATTERN = r"^[A-Za-z0-9._:-]+$"


class CtxgateDocument(_Strict):
    text: str = Field(default=..., description="the passage's text")
    id: str | int | None = Field(
        default=None, description="the caller's id for the passage, kept in the report"
    )
    title: str | None = Field(
        default=None,
        max_length=MAX_DOCUMENT_TITLE_CHARS,
        description="the passage's title: shown with it and scored with it",
    )
    score: float | None = Field(
        default=None, description="the retriever's score: the higher copy wins a dedup tie"
    )

    @field_validator("id")
    @classmethod
    def _short_id(cls, value: str | int | None) -> str | int | None:
        # A validator, not a constrained str: the union would report the int branch's error too.
        if isinstance(value, str) and len(value) > MAX_DOCUMENT_ID_CHARS:
            raise ValueError(f"String should have at most {MAX_DOCUMENT_ID_CHARS} characters")
        return value


class CtxgateRetrieval(_Strict):
    index: str = Field(
        default=...,
        min_length=1,
        description="a local index built by `ctxgate index build`, one the tenant may search",
    )
    top_n: int = Field(default=5, ge=1, le=100, description="passages retrieved from it")


class CtxgateExtras(_Strict):
    documents: list[CtxgateDocument] | None = Field(
        default=None, description="the retrieved passages to fit into the policy's documents budget"
    )
    retrieval: CtxgateRetrieval | None = Field(
        default=None, description="retrieve the passages from a local index instead"
    )
    policy: str | None = Field(
        default=None,
        min_length=1,
        description="the policy to apply; default: the key's tenant's, else the server's default_policy",
    )
    priority: Literal["user", "background"] | None = Field(
        default=None, description="user requests are scheduled before background ones; default: user"
    )
    overrides: dict[str, Any] | None = Field(
        default=None, description="dotted policy fields to override, only those the policy allows"
    )
    conversation_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_CONVERSATION_ID_CHARS,
        pattern=CONVERSATION_ID_PATTERN,
        description="the conversation this request continues, for the policy's conversation memory; "
        "default: recognised by its system prompt and first user turn",
    )


class _GatewayFields(BaseModel):
    # The gateway picks the policy budget by model, so the model is required (as in OpenAI's API).
    model: str = Field(default=..., min_length=1)
    ctxgate: CtxgateExtras | None = None


class ChatCompletionRequest(_GatewayFields, openai.ChatCompletionRequest):
    pass


class CompletionRequest(_GatewayFields, openai.CompletionRequest):
    # Text only: the budget and the sanitiser work on text, never on client-chosen token ids.
    prompt: str | list[str]


GatewayRequest = ChatCompletionRequest | CompletionRequest
