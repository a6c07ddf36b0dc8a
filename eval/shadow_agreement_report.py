"""`ctxgate eval shadow-agreement`'s report: the live shadow agreement on a QA dataset beside the
offline answer retention of the same questions, and what separates the two.

Retention asks of the compressed prompt whether a gold answer string is still in it; agreement asks
of the model whether its answer from the compressed prompt is the answer it gives from the whole one.
They part where the model does not use what the prompt keeps (a retained answer, a different reply)
or where the uncompressed prompt's answer is itself not the gold one (a small model's answer to
twenty passages often is not), so the report gives both answers' accuracy and the agreement split by
whether the answer was retained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ctxgate.eval.stats import bootstrap_mean


@dataclass
class QuestionAgreement:
    """One question: its live request, the prompt the live answer came from, and its shadow comparison."""

    question_id: str
    answers: list[str]
    request_id: str | None = None
    answer_retained: bool | None = None  # a gold answer in the compressed prompt (None: yes/no)
    prompt_tokens: int | None = None
    original_prompt_tokens: int | None = None
    live_answer: str | None = None
    shadow_answer: str | None = None  # None: not compared
    agreement: float | None = None  # the policy's measure (token_f1 for a text answer)
    exact: float | None = None
    key_spans: float | None = None
    live_correct: bool | None = None  # a gold answer in the reply
    shadow_correct: bool | None = None
    dropped: str | None = None  # the reason the shadow comparison was dropped
    error: str | None = None  # the live request failed


def _estimate(values: Sequence[float | None]) -> dict[str, Any]:
    estimate = bootstrap_mean(values)
    interval = None if estimate.ci_low is None else [round(estimate.ci_low, 4), round(estimate.ci_high, 4)]
    value = None if estimate.value is None else round(estimate.value, 4)
    return {"value": value, "interval": interval, "n": estimate.n}


def _share(flags: Sequence[bool | None]) -> list[float | None]:
    return [None if flag is None else float(flag) for flag in flags]


def summarize(rows: Sequence[QuestionAgreement], dropped: dict[str, int]) -> dict[str, Any]:
    compared = [row for row in rows if row.agreement is not None]
    retained = [row for row in compared if row.answer_retained]
    lost = [row for row in compared if row.answer_retained is False]
    shadow_right = [row for row in compared if row.shadow_correct]
    return {
        "questions": len(rows),
        "errors": sum(1 for row in rows if row.error),
        "compared": len(compared),
        "dropped": dropped,
        "agreement": _estimate([row.agreement for row in compared]),
        "exact_agreement": _estimate([row.exact for row in compared]),
        "key_span_agreement": _estimate([row.key_spans for row in compared]),
        # Over every question (the offline figure's population), not only the compared ones.
        "answer_retention": _estimate(_share([row.answer_retained for row in rows])),
        "agreement_where_retained": _estimate([row.agreement for row in retained]),
        "agreement_where_lost": _estimate([row.agreement for row in lost]),
        "live_accuracy": _estimate(_share([row.live_correct for row in compared])),
        "shadow_accuracy": _estimate(_share([row.shadow_correct for row in compared])),
        # Of the questions the whole prompt answered right, the share the compressed one did too:
        # the answer-level twin of retention.
        "answer_kept_where_shadow_right": _estimate(_share([row.live_correct for row in shadow_right])),
    }


def _f(estimate: dict[str, Any]) -> str:
    if estimate["value"] is None:
        return "–"
    interval = estimate["interval"]
    span = f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""
    return f"{estimate['value']:.3f}{span} (n={estimate['n']})"


def render_markdown(report: dict[str, Any]) -> str:
    summary = report["summary"]
    dropped = ", ".join(f"{reason} {count}" for reason, count in summary["dropped"].items()) or "none"
    lines = [
        f"# Shadow agreement of {report['policy']} on {report['questions_from']}",
        "",
        f"- Command: `{report['command']}`",
        f"- {summary['questions']} questions ({report['split']} split, the first {summary['questions']}), one "
        f"at a time on an idle gateway with `shadow: {report['shadow']}`, {report['max_tokens']} answer "
        "tokens, greedy; the next question is sent once the last one's shadow comparison is settled",
        f"- Compared {summary['compared']} of {summary['questions']}; dropped: {dropped}; live errors "
        f"{summary['errors']}",
        "",
        "| measure | value [95% interval] |",
        "|---|---|",
        f"| shadow agreement ({report['comparison']}, the policy's measure) | {_f(summary['agreement'])} |",
        f"| exact agreement (normalised answers equal) | {_f(summary['exact_agreement'])} |",
        f"| key-span agreement | {_f(summary['key_span_agreement'])} |",
        f"| answer retention (offline: a gold answer in the compressed prompt) | "
        f"{_f(summary['answer_retention'])} |",
        f"| agreement where the answer was retained | {_f(summary['agreement_where_retained'])} |",
        f"| agreement where it was lost | {_f(summary['agreement_where_lost'])} |",
        f"| live answer correct (compressed prompt) | {_f(summary['live_accuracy'])} |",
        f"| shadow answer correct (whole prompt) | {_f(summary['shadow_accuracy'])} |",
        f"| live correct where the shadow was | {_f(summary['answer_kept_where_shadow_right'])} |",
        "",
        "Retention asks whether the compressed prompt still holds a gold answer; agreement asks whether "
        "the model answers the compressed prompt as it answers the whole one. A retained answer the "
        "model does not pick, and a whole-prompt answer that is itself wrong, part the two "
        '(docs/deploying.md, "Shadow agreement").',
    ]
    return "\n".join(lines) + "\n"


def rows_as_dicts(rows: Sequence[QuestionAgreement]) -> list[dict[str, Any]]:
    return [asdict(row) for row in rows]
