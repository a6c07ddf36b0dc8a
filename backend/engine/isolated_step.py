"""One step's model run and sampling, with a failure kept to the sequences that cause it.

Every tenant's sequences share one batched forward pass and one batched sampling call, so one
request that makes either raise would otherwise fail them all. The fast path is the batched call as
it always was; only after it raises are the culprits looked for: the forward pass by bisecting the
batch (re-running halves until the failing sequences are alone), sampling by sampling each row on
its own (`ctxgate.backend.engine.sampler.sample_each`). The culprits are reported as failures; everyone else's
tokens are kept as if nothing happened.

Re-running a forward pass on part of the batch is safe: a sequence's KV writes go to slots the
scheduler already gave it, for positions whose tokens do not change, so a second write is the same
write; its computed-token count only moves once the step's outcome is known.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from ctxgate.backend.engine.api import EngineError
from ctxgate.backend.engine.model_runner import ModelRunner, ModelRunnerOutput
from ctxgate.backend.engine.sampler import RowFailure, SampledToken, sample_each, sample_tokens
from ctxgate.backend.engine.scheduler import ScheduledSequence
from ctxgate.backend.engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class StepRun:
    """What one step computed: the sequences whose forward pass ran, the tokens sampled, and the
    sequences that failed (with the error their request ends with)."""

    ran: list[ScheduledSequence] = field(default_factory=list)
    sampled: list[tuple[Sequence, SampledToken]] = field(default_factory=list)
    failed: list[tuple[Sequence, EngineError]] = field(default_factory=list)


def run_step(
    runner: ModelRunner, scheduled: list[ScheduledSequence], eos_token_ids: Iterable[int], eager: bool = False
) -> StepRun:
    """`eager`: never through the decode graphs (`ModelRunner.execute`)."""
    run = StepRun()
    _forward(runner, scheduled, tuple(eos_token_ids), run, eager)
    return run


def _forward(
    runner: ModelRunner, scheduled: list[ScheduledSequence], eos: tuple[int, ...], run: StepRun, eager: bool
) -> None:
    try:
        result = runner.execute(scheduled, eager)
    except Exception:
        if len(scheduled) == 1:
            seq = scheduled[0].seq
            logger.exception(
                "the model's forward pass failed for request %s alone; it is aborted", seq.request_id
            )
            run.failed.append(
                (seq, EngineError("the model failed on this request", 500, code="engine_error"))
            )
            return
        logger.warning(
            "a forward pass of %d sequences failed; re-running it in halves to find the cause",
            len(scheduled),
            exc_info=True,
        )
        middle = len(scheduled) // 2
        _forward(runner, scheduled[:middle], eos, run, eager)
        _forward(runner, scheduled[middle:], eos, run, eager)
        return
    run.ran.extend(scheduled)
    _sample(result, eos, run)


def _sample(result: ModelRunnerOutput, eos: tuple[int, ...], run: StepRun) -> None:
    sequences = result.sampled_sequences
    try:
        tokens: list[SampledToken | RowFailure] = list(sample_tokens(result.logits, sequences, eos))
    except Exception:
        logger.warning(
            "sampling %d rows failed; sampling them one at a time to find the cause",
            len(sequences),
            exc_info=True,
        )
        tokens = sample_each(result.logits, sequences, eos)
    for seq, token in zip(sequences, tokens, strict=True):
        if isinstance(token, RowFailure):
            logger.warning(
                "request %s failed to sample at the %s stage: %r", seq.request_id, token.stage, token.error
            )
            run.failed.append((seq, _sampling_error(token)))
        else:
            run.sampled.append((seq, token))


def _sampling_error(failure: RowFailure) -> EngineError:
    # The row fails alone, so it is this request's fields at that stage; the library's own message
    # (tensor shapes, internals) stays in the log.
    fields = ", ".join(failure.fields)
    return EngineError(
        f"sampling failed at the {failure.stage} stage; check {fields}",
        400,
        param=failure.fields[0],
        code="invalid_value",
    )
