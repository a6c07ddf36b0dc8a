"""Turning one sampled token into what the client sees: finish checks, stop strings, text deltas.

Invariant: a delta never carries text that could still turn out to be the start of a stop string
(such a tail is held back until the next token confirms or rules it out), and the text of a
finished sequence never contains a stop string.
"""

from __future__ import annotations

from ctxgate.backend.engine.api import GenerationDelta, Priority, RequestMetrics, TokenLogprob
from ctxgate.backend.engine.sequence import Sequence


class OutputProcessor:
    def __init__(self, eos_token_ids: set[int] | frozenset[int], max_model_len: int, ttft_target_ms: float):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.ttft_target_ms = ttft_target_ms
        self.ttft_target_misses = 0  # cumulative

    def append_token(
        self, seq: Sequence, token: int, now: float, logprob: TokenLogprob | None = None
    ) -> GenerationDelta:
        """Append `token` to `seq` and return the delta to stream (its choice's finish reason set when
        it ends the choice)."""
        seq.token_ids.append(token)
        if seq.matcher is not None:
            seq.matcher.accept(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
            # A shadow request waits behind every live one by design: its wait is no missed target.
            late = (now - seq.arrival_time) * 1000.0 > self.ttft_target_ms
            if late and seq.priority is not Priority.SHADOW:
                self.ttft_target_misses += 1
        finish_reason = self._finish_reason(seq, token)
        if finish_reason is None and seq.matcher is not None and seq.matcher.terminated:
            finish_reason = "stop"  # the grammar is complete (its stop token was sampled)

        assert seq.detokenizer is not None
        seq.detokenizer.add([token])
        text = seq.detokenizer.text
        if finish_reason is not None:
            text += seq.detokenizer.flush()
        stop_at = find_stop_string(seq, text)
        if stop_at is not None:
            text = text[:stop_at]
            finish_reason = "stop"
        stops = seq.sampling.stop
        if finish_reason is None and stops:
            emit_until = max(seq.emitted_text_len, len(text) - (max(map(len, stops)) - 1))
        else:
            emit_until = len(text)
        delta = GenerationDelta(
            request_id=seq.request_id,
            text=text[seq.emitted_text_len : emit_until],
            token_ids=[token],
            index=seq.index,
            choice_finish_reason=finish_reason,
            logprobs=[logprob] if logprob is not None else None,
        )
        seq.emitted_text_len = emit_until
        return delta

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None


def find_stop_string(seq: Sequence, text: str) -> int | None:
    """Where the first stop string starts in `text`, or None."""
    if not seq.sampling.stop:
        return None
    # Only the text not yet emitted (plus the held-back tail) can contain a new match.
    search_from = max(0, seq.emitted_text_len - max(map(len, seq.sampling.stop)))
    positions = [p for p in (text.find(stop, search_from) for stop in seq.sampling.stop) if p >= 0]
    return min(positions) if positions else None


def finished_metrics(seq: Sequence, now: float) -> RequestMetrics:
    """A finished sequence's timings, from arrival to its last token."""
    first_token = seq.first_token_time or now
    first_scheduled = seq.first_scheduled_time or seq.arrival_time
    num_output = seq.num_output_tokens
    return RequestMetrics(
        queue_ms=(first_scheduled - seq.arrival_time) * 1000.0,
        prefill_ms=(first_token - first_scheduled) * 1000.0,
        ttft_ms=(first_token - seq.arrival_time) * 1000.0,
        tpot_ms=(now - first_token) * 1000.0 / (num_output - 1) if num_output > 1 else 0.0,
        e2e_ms=(now - seq.arrival_time) * 1000.0,
        cached_prompt_tokens=seq.cached_prompt_tokens or 0,
        preemptions=seq.num_preemptions,
    )
