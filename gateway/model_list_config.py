"""The config file's `model_list:` section: served model names, each backed by a group of deployments.

    model_list:
      - model_name: chat                  # what clients send as `model`
        routing: cache_affinity           # least_outstanding (default) | weighted_round_robin | cache_affinity
        fallbacks: [chat-large]           # tried in order when this group cannot take a request
        deployments:
          - url: http://engine-1:8001/v1
            model: SmolLM2-135M-Instruct  # the name upstream; default: discovered from its /v1/models
            api_key: os.environ/ENGINE_KEY
            weight: 2
            max_parallel_requests: 16
          - url: http://engine-2:8001/v1
        tokenizer: ./SmolLM2.gguf         # budgets counted with this (a GGUF, HF dir or tiktoken name)
      - model_name: local
        deployments:
          - engine: builtin               # the in-process engine (the `engine:` section)

Import-light (pydantic only): `ctxgate --help` and the settings import it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ctxgate.backend.routing.strategies import Strategy

MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeploymentConfig(_Strict):
    """One place the model is served: an OpenAI-compatible URL, or the built-in engine."""

    url: str | None = Field(
        default=None, description="the server's base URL (http:// or https://, with or without /v1)"
    )
    engine: Literal["builtin"] | None = Field(
        default=None,
        description="`builtin`: the in-process engine configured by "
        "the `engine:` section (at most one in the whole list)",
    )
    model: str | None = Field(
        default=None,
        description="the model name sent upstream; default: the first model of the upstream's /v1/models",
    )
    api_key: str | None = Field(
        default=None,
        repr=False,
        description="Bearer key for this upstream (write it as "
        "os.environ/NAME); default: server.upstream_api_key",
    )
    weight: float = Field(
        default=1.0,
        gt=0,
        le=1000,
        description="share of the group's traffic (weighted round robin), "
        "of its load (least outstanding) and of the ring (cache affinity)",
    )
    max_parallel_requests: int | None = Field(
        default=None,
        ge=1,
        description="requests this gateway sends it at once; "
        "beyond that it is skipped (all full: 503 overloaded or a fallback)",
    )

    @model_validator(mode="after")
    def _one_target(self) -> DeploymentConfig:
        if (self.url is None) == (self.engine is None):
            raise ValueError("a deployment needs exactly one of url or engine: builtin")
        if self.engine is not None and (self.model or self.api_key):
            raise ValueError("model and api_key are for url deployments")
        return self

    @field_validator("url")
    @classmethod
    def _http(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://: {url}")
        return url.rstrip("/") if url is not None else None


class HealthConfig(_Strict):
    """Passive ejection and active probes of a group's deployments (backend/routing/deployment_health.py)."""

    failures_to_eject: int = Field(
        default=3, ge=1, description="failed requests in a row that eject a deployment"
    )
    eject_s: float = Field(
        default=5.0, gt=0, description="seconds of the first ejection; doubled on each ejection in a row"
    )
    max_eject_s: float = Field(default=60.0, gt=0, description="longest ejection")
    probe_interval_s: float = Field(
        default=5.0,
        ge=0,
        description="seconds between GETs of each deployment's /health "
        "(a failure ejects, a success ends an ejection); 0: no probes",
    )


class ModelConfig(_Strict):
    """A served model name and the deployments behind it."""

    model_name: str = Field(
        ...,
        pattern=MODEL_NAME_PATTERN,
        description="the name clients send as `model` and keys' `models` lists name",
    )
    deployments: list[DeploymentConfig] = Field(..., min_length=1, description="where the model is served")
    routing: Strategy = Field(
        default="least_outstanding", description="least_outstanding, weighted_round_robin or cache_affinity"
    )
    load_factor: float = Field(
        default=1.25,
        ge=1,
        le=10,
        description="cache_affinity: a deployment takes a request "
        "only while under this times its share of the group's requests in flight",
    )
    affinity_prefix_chars: int = Field(
        default=2048,
        ge=16,
        le=1_000_000,
        description="cache_affinity: characters of the "
        "prompt's stable prefix (system prompt and first user turn, after "
        "compression) that key the ring",
    )
    tokenizer: str | None = Field(
        default=None,
        description="what this model's budgets are counted, its prompt rendered "
        "and its special tokens neutralised with: a GGUF file, a local HF tokenizer "
        "directory or a tiktoken encoding name (e.g. cl100k_base); default: the "
        "gateway's (`server.tokenizer`, else the built-in engine's). Not for the "
        "built-in engine, which always counts with its own",
    )
    fallbacks: list[str] = Field(
        default_factory=list,
        description="served model names tried in order when no "
        "deployment can take a request (5xx, timeout, overload) before any token flowed",
    )
    health: HealthConfig = Field(default_factory=HealthConfig, description="ejection and probes")

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_found(cls, spec: str | None) -> str | None:
        from ctxgate.gateway.tokenizer_spec import (
            check_tokenizer_spec,  # tiktoken's names: only when one is named
        )

        return check_tokenizer_spec(spec) if spec is not None else None

    @model_validator(mode="after")
    def _builtin_counts_itself(self) -> ModelConfig:
        # The built-in engine is sent the token ids the gateway encoded: only its own tokenizer's are right.
        if self.tokenizer is not None and any(entry.engine is not None for entry in self.deployments):
            raise ValueError(
                f"model '{self.model_name}': the built-in engine counts with its own tokenizer; "
                "`tokenizer` is for url deployments"
            )
        return self


def check_model_list(models: list[ModelConfig]) -> list[ModelConfig]:
    """Unique names, fallbacks that exist (not the model itself), at most one built-in engine."""
    names = [model.model_name for model in models]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"model_name listed twice: {', '.join(duplicates)}")
    for model in models:
        for target in model.fallbacks:
            if target not in names or target == model.model_name:
                raise ValueError(
                    f"model '{model.model_name}': fallback '{target}' is not another listed model"
                )
    builtins = sum(deployment.engine is not None for model in models for deployment in model.deployments)
    if builtins > 1:
        raise ValueError("the built-in engine may be a deployment of one model only")
    return models


def builtin_needed(models: list[ModelConfig], upstreams: list[str]) -> bool:
    """Whether the in-process engine serves: a model list naming it, or no upstreams at all."""
    if models:
        return any(deployment.engine is not None for model in models for deployment in model.deployments)
    return not upstreams
