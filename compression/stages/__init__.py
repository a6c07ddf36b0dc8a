"""The pipeline's stages, in the one ordered list `STAGES` that `CompressionPipeline` runs.

    retrieval -> message-context -> cost-check -> conversation -> history -> dedup -> rerank -> extraction -> assembly -> fit

One module per stage, each stating its rule; `base` holds what a stage is (`Stage`,
`StageContext`), `budget` the token accounting the stages share, `prepare` the per-request work
done on first need (sentence split, pre-filter, the question's embedding). Stage estimates come
from cached per-unit counts; the fit stage checks the exact count of the final prompt. When the
cost check decides compressing does not pay (or the policy disables it), the compressing stages
stand aside and the fit sends the original. The multi-hop logic the rerank and extraction stages
call lives in ctxgate.compression.multihop.
"""

from __future__ import annotations

from ctxgate.compression.stages.assembly import AssemblyStage
from ctxgate.compression.stages.base import Stage
from ctxgate.compression.stages.conversation import ConversationStage
from ctxgate.compression.stages.cost_check import CostCheckStage
from ctxgate.compression.stages.dedup import DedupStage
from ctxgate.compression.stages.extraction import ExtractionStage
from ctxgate.compression.stages.fit import FitStage
from ctxgate.compression.stages.history import HistoryStage
from ctxgate.compression.stages.lift_context import MessageContextStage
from ctxgate.compression.stages.rerank import RerankStage
from ctxgate.compression.stages.retrieval import RetrievalStage

# The pipeline, in order. Retrieval and the context found inside messages come first because the
# original prompt (and the cost check) must include those passages; history runs before the documents stages because the
# documents get what the system prompt, question and kept history leave. The conversation stage
# carries a remembered conversation's turns as they were sent (the history stage then stands aside).
STAGES: tuple[Stage, ...] = (
    RetrievalStage(),
    MessageContextStage(),
    CostCheckStage(),
    ConversationStage(),
    HistoryStage(),
    DedupStage(),
    RerankStage(),
    ExtractionStage(),
    AssemblyStage(),
    FitStage(),
)
