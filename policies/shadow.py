"""The `shadow:` policy section: answer a sample of live requests a second time from the uncompressed
prompt on idle capacity, and compare the two answers (gateway/shadow/).

The shadow request is greedy and runs at the engine's lowest priority; it never delays a live one
(docs/deploying.md, "Shadow agreement").
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Comparison = Literal["auto", "exact", "token_f1", "key_spans", "json_fields"]


class ShadowPolicy(BaseModel):
    # Unknown keys are typos in an operator's YAML: reject them with the field's name.
    model_config = ConfigDict(extra="forbid")

    sample_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="share of the live requests answered again from the uncompressed prompt; 0: off",
    )
    max_in_flight: int = Field(
        default=2, ge=1, le=64, description="shadow requests running at once (per gateway); more are dropped"
    )
    max_prompt_tokens: int = Field(
        default=8192,
        ge=16,
        description="an uncompressed prompt longer than this is not shadowed (dropped: too_long)",
    )
    only_when_idle: bool = Field(
        default=True,
        description="shadow only while the engine's waiting queue is empty and its KV cache use is "
        "under max_kv_usage (an upstream: as its /metrics says; unknown: upstream_fixed_rate applies)",
    )
    max_kv_usage: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="only_when_idle: KV cache use at or above which nothing is shadowed",
    )
    output_tokens: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="the shadow answer's max_tokens; null: the live request's",
    )
    comparison: Comparison = Field(
        default="auto",
        description="the agreement measure: exact (normalised), token_f1, key_spans (numbers, names and "
        "dates of the shadow answer found in the live one), json_fields; auto: json_fields for JSON "
        "output, else token_f1",
    )
    alert_below: float = Field(
        default=0.8,
        ge=0,
        le=1,
        description="the policy's agreement threshold, exported as ctxgate:shadow_alert_threshold for "
        "the shipped alert rule",
    )
    upstream_fixed_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="an upstream whose load is unknown (its /metrics shows no queue): shadow this "
        "share of requests, whatever its load, instead of sample_rate; 0: not shadowed",
    )
    timeout_s: float = Field(
        default=60.0, gt=0, le=600, description="a shadow request taking longer is aborted (dropped: timeout)"
    )
