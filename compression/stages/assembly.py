"""The assembly stage: orders the kept passages against "lost in the middle".

Rule: it only orders (`assembly.order`); the fit stage renders them.
"""

from __future__ import annotations

from ctxgate.compression.rendering import order_passages
from ctxgate.compression.stages.base import Stage, StageContext
from ctxgate.compression.state import PipelineState
from ctxgate.compression.types import StageReport


class AssemblyStage(Stage):
    """Orders the kept passages against "lost in the middle"; the fit stage renders them."""

    name = "assembly"

    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport:
        state.passages = order_passages(state.passages, ctx.policy.assembly.order)
        return StageReport(self.name, details={"order": ctx.policy.assembly.order})
