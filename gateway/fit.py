"""Compress-to-fit admission: a request that does not fit a limit gets a smaller prompt budget
instead of a refusal, when its policy's `fit` section says `compress` for that limit.

The limits: the tenant's tokens left in the quota window (`quota`), its spend left (`spend`: the
daily spend limit or the budget, turned into the tokens it buys at the policy's prices), the model's
context window (`context_window`) and the policy's `max_input_tokens`. The prompt budget a fitted
request gets is what the limit leaves after its output reservation, never under `fit.min_context_tokens`; when the
output reservation alone leaves less than that floor, `fit.output: cap` lowers max_tokens so the
prompt keeps the floor (the answer then ends with finish_reason `length` as any capped one). Under
the floor the request is refused as it would have been, saying what it would have needed.

This module decides; `Accounting` reads the room left and `Preparation` compresses with the
fitted policy (`Fit.apply`), then reserves exactly as for any request, so a fitted request can
still be refused by the atomic reservation when another took the same room first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ctxgate.gateway.quota import SPEND_SCALE
from ctxgate.policies.schema import FitPolicy, Policy

FitLimit = Literal["quota", "spend", "context_window", "max_input_tokens"]


@dataclass(frozen=True)
class Fit:
    """A request fitted into a limit: the limit, the prompt budget and per-choice output it got,
    and what it would have needed at the policy's normal budget (prompt bound + output)."""

    bound_by: FitLimit
    budget: int
    output_tokens: int
    would_have_needed: int
    # A quota fit: the quota's refusal, answered again if the fitted prompt cannot be built.
    reason: str = "prompt_too_long"
    retry_after_s: int = 1

    def apply(self, policy: Policy) -> Policy:
        """`policy` with its budgets lowered to the fit (never raised), compressing whatever it said."""
        budget = min(policy.max_input_tokens, self.budget)
        return policy.model_copy(
            update={
                "max_input_tokens": budget,
                "documents": policy.documents.model_copy(
                    update={"max_tokens": min(policy.documents.max_tokens, budget)}
                ),
                "reserve_output_tokens": min(policy.reserve_output_tokens, max(1, self.output_tokens)),
                "compression_enabled": True,
            }
        )

    def report(self) -> dict[str, int | str]:
        return {"bound_by": self.bound_by, "budget": self.budget, "would_have_needed": self.would_have_needed}


class FitRefused(Exception):
    """Under the floor: the request is refused as before, with what it would have needed."""

    def __init__(self, limit: FitLimit, needed: int, room: int, floor: int):
        super().__init__(
            f"the request needs {needed} tokens (prompt and output) and {_room_text(limit, room)}; "
            f"fitting it would leave the prompt under the policy's floor of {floor} tokens (fit.min_context_tokens)"
        )
        self.limit = limit
        self.needed = needed
        self.room = room


def _room_text(limit: FitLimit, room: int) -> str:
    if limit == "spend":
        return f"the tenant's spend left ({room / SPEND_SCALE:g} at the policy's prices) buys fewer"
    words = {
        "quota": "the tenant's quota has left",
        "context_window": "the model's context window holds",
        "max_input_tokens": "max_input_tokens allows",
    }[limit]
    return f"{words} {room}"


@dataclass(frozen=True)
class Prices:
    """What one prompt token and one output token take of a limit's room: one each for a token limit,
    their price in micro-units of the currency for a spend limit."""

    prompt: float = 1.0
    output: float = 1.0


TOKENS = Prices()


def fit_into(
    fit: FitPolicy,
    limit: FitLimit,
    room: int,
    prompt_tokens: int,
    output_tokens: int,
    choices: int,
    prices: Prices = TOKENS,
) -> Fit | None:
    """The fit of a request needing `prompt_tokens` + `output_tokens` (all choices) into `room`
    (tokens, or micro-units of spend at `prices`) for prompt and output together; None when it fits
    as it is. Raises `FitRefused` when the prompt would get less than the floor (and, with
    `fit.output: reject`, when only a lower max_tokens would keep it)."""
    needed = prompt_tokens + output_tokens
    if prices.prompt * prompt_tokens + prices.output * output_tokens <= room:
        return None
    floor = fit.min_context_tokens
    per_choice = output_tokens // choices if choices else 0

    def prompt_room(per_choice: int) -> float:
        return room - prices.output * per_choice * choices

    if prompt_room(per_choice) < prices.prompt * floor:
        if fit.output == "reject" or not choices or prices.output <= 0:
            raise FitRefused(limit, needed, room, floor)
        # The prompt keeps the floor (or all of itself, if smaller); the output gets the rest.
        per_choice = int((room - prices.prompt * min(floor, prompt_tokens)) // (prices.output * choices))
        if per_choice < 1:
            raise FitRefused(limit, needed, room, floor)
    if prices.prompt <= 0:
        return Fit(limit, prompt_tokens, per_choice, needed)
    budget = min(prompt_tokens, int(prompt_room(per_choice) // prices.prompt))
    return Fit(limit, budget, per_choice, needed)
