"""What every stage is: `enabled(state, policy)` says whether it runs for this request, `run(state,
ctx)` reads and writes the typed `PipelineState` and reports the tokens it removed.

Rule: a stage touches nothing but the state and what `StageContext` gives it (the request's policy,
the shared counter and services); compressing stages stand aside once the cost check decided to
send the original.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ctxgate.compression.counting import CachedCounter
from ctxgate.compression.services import Services
from ctxgate.compression.state import PipelineState
from ctxgate.compression.types import StageReport
from ctxgate.policies.schema import Policy


@dataclass
class StageContext:
    """What a stage may use besides the state: the request's policy and the shared services."""

    policy: Policy
    counter: CachedCounter
    services: Services

    def question_vector(self, state: PipelineState) -> np.ndarray:
        vector = state.question_vector
        if vector is None:
            vector = state.question_vector = self.services.embedder.embed([state.question_text])[0]
        return vector


class Stage(ABC):
    name: ClassVar[str]

    def enabled(self, state: PipelineState, policy: Policy) -> bool:
        """Compressing stages run unless the cost check decided to send the original."""
        return state.compressing

    @abstractmethod
    async def run(self, state: PipelineState, ctx: StageContext) -> StageReport: ...


async def run_timed(stage: Stage, state: PipelineState, ctx: StageContext) -> StageReport:
    started = time.perf_counter()
    report = await stage.run(state, ctx)
    report.ms = (time.perf_counter() - started) * 1000
    return report
