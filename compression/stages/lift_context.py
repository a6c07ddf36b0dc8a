"""The message-context stage: retrieved context rendered inside the system/user messages becomes
passages for the stages below.

Rule: it runs before the cost check (the original prompt includes these passages); the renderer
puts what is kept back where it was found (compression/context_lifting.py).
"""

from __future__ import annotations

from typing import Any

from ctxgate.compression.context_lifting import lift_context
from ctxgate.compression.stages.base import Stage, StageContext
from ctxgate.compression.stages.budget import passages_tokens
from ctxgate.compression.state import PipelineState
from ctxgate.compression.types import StageReport
from ctxgate.policies.schema import Policy


class MessageContextStage(Stage):
    """Retrieved context rendered inside the system/user messages becomes passages for the stages
    below; the renderer puts what is kept back where it was (compression/context_lifting.py)."""

    name = "message-context"

    def enabled(self, state: PipelineState, policy: Policy) -> bool:
        return policy.documents.from_messages

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        lifted = lift_context(state)
        if not lifted:
            return StageReport(self.name, details={"passages_found": 0, "tokens_found": 0})
        passages = [p for p in state.passages if p.frame is not None]
        details: dict[str, Any] = {
            "message": ", ".join(dict.fromkeys(where for where, _ in lifted)),
            "layout": ", ".join(dict.fromkeys(found.layout for _, found in lifted)),
            "passages_found": len(passages),
            "tokens_found": passages_tokens(ctx.counter, passages),
        }
        if len(lifted) > 1:
            details["blocks"] = [
                {"message": where, "layout": found.layout, "passages": len(found.passages)}
                for where, found in lifted
            ]
        return StageReport(self.name, details=details)
