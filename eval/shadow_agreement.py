"""`ctxgate eval shadow-agreement`: the live shadow comparison run on a QA dataset, beside the offline
answer retention of the same questions (issue 53's acceptance figure).

A real `ctxgate serve` runs the policy with `shadow: {sample_rate: 1}` and a shadow log. The questions
go one at a time, each sent once the previous one's shadow comparison has settled (compared or
dropped), so the engine is idle whenever a shadow request asks for room: every request is compared
unless its prompt was not compressed or too long for the shadow. Each question's compressed prompt
is fetched from /v1/ctxgate/compress (what the live request was sent; deterministic per question)
and scored for answer retention as `ctxgate eval retention` scores it; the shadow log gives each
request's two answers and measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ctxgate.eval.client import ctxgate_extra, question_messages
from ctxgate.eval.datasets import EvalExample, load_dataset, resolve_dataset_path
from ctxgate.eval.evidence import evidence_retention
from ctxgate.eval.metrics import answer_in_text
from ctxgate.eval.shadow_agreement_report import QuestionAgreement, render_markdown, rows_as_dicts, summarize
from ctxgate.eval.shadow_setup import (
    ShadowCounts,
    policy_source,
    read_counts,
    shadowed_policy,
    write_policy_dir,
)
from ctxgate.eval.splits import split_examples

# How long one question's shadow comparison may take to settle before the run gives up on it (the
# policy's own timeout_s drops it first; this bounds a gateway that never reports).
SETTLE_GRACE_S = 30.0
POLL_S = 0.2


@dataclass
class AgreementOptions:
    dataset: str = "nq-multidoc-dev.jsonl"
    split: str = "all"  # `ctxgate eval retention`'s default: the same first N questions
    limit: int = 50
    policy: str = "rag-default"
    max_tokens: int = 32  # `ctxgate eval run`'s default answer length
    shadow_timeout_s: float = 600.0  # a whole multi-document prompt on a busy CPU takes a while
    model: str | None = None
    policy_dir: str | None = None
    progress: bool = True
    shadow: dict[str, Any] = field(default_factory=dict)

    def shadow_section(self) -> dict[str, Any]:
        return {"sample_rate": 1, "timeout_s": self.shadow_timeout_s} | self.shadow


def read_shadow_log(path: Path) -> dict[str, dict[str, Any]]:
    """The shadow log's lines by request id (a line that is not a JSON object is left out)."""
    entries: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return entries
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            item = json.loads(line)
            if isinstance(item, dict) and "request_id" in item:
                entries[str(item["request_id"])] = item
    return entries


def fill_from_log(row: QuestionAgreement, entry: dict[str, Any] | None) -> None:
    if entry is None:
        return
    measures = entry.get("measures") or {}
    row.shadow_answer = str(entry.get("shadow_answer", ""))
    row.agreement = float(entry["agreement"])
    row.exact = measures.get("exact")
    row.key_spans = measures.get("key_spans")
    row.shadow_correct = answer_in_text(row.shadow_answer, row.answers)


class AgreementRun:
    def __init__(self, url: str, model: str, options: AgreementOptions):
        self.url = url
        self.model = model
        self.options = options

    def body(self, example: EvalExample) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": question_messages(example),
            "max_tokens": self.options.max_tokens,
            "temperature": 0,
            **ctxgate_extra(example, self.options.policy),
        }

    async def settle(self, client: httpx.AsyncClient, before: ShadowCounts) -> ShadowCounts:
        """Wait until the question's request has been drawn (at sample_rate 1, always: the draw
        follows the answer, so it may come after the reply) and compared or dropped."""
        deadline = time.monotonic() + self.options.shadow_timeout_s + SETTLE_GRACE_S
        while True:
            now = await read_counts(client, self.url, self.options.policy)
            drawn = now.sampled - before.sampled
            if drawn > 0 and now.settled - before.settled >= drawn:
                return now
            if time.monotonic() > deadline:
                raise RuntimeError("a shadow comparison did not settle in time: see the gateway log")
            await asyncio.sleep(POLL_S)

    async def one(
        self, client: httpx.AsyncClient, example: EvalExample
    ) -> tuple[QuestionAgreement, ShadowCounts]:
        row = QuestionAgreement(question_id=example.id, answers=list(example.answers))
        before = await read_counts(client, self.url, self.options.policy)
        response = await client.post(self.url + "/v1/chat/completions", json=self.body(example))
        if response.status_code != 200:
            row.error = f"HTTP {response.status_code}: {response.text[:300]}"
            return row, before
        reply = response.json()
        usage = reply.get("usage") or {}
        row.request_id = str(reply.get("id"))
        row.live_answer = reply["choices"][0]["message"].get("content") or ""
        row.live_correct = answer_in_text(row.live_answer, row.answers)
        row.prompt_tokens = usage.get("prompt_tokens")
        row.original_prompt_tokens = (usage.get("ctxgate") or {}).get("original_prompt_tokens")
        after = await self.settle(client, before)
        dropped = after.since(before).dropped
        row.dropped = next(iter(dropped), None)
        compress = {
            "model": self.model,
            "messages": question_messages(example),
            **ctxgate_extra(example, self.options.policy),
        }
        sent = await client.post(self.url + "/v1/ctxgate/compress", json=compress)
        sent.raise_for_status()
        row.answer_retained = evidence_retention(example, sent.json()["messages"]).answer_retained
        return row, after

    async def run(
        self, examples: list[EvalExample], log_path: Path
    ) -> tuple[list[QuestionAgreement], ShadowCounts]:
        rows: list[QuestionAgreement] = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(900)) as client:
            first = await read_counts(client, self.url, self.options.policy)
            last = first
            for index, example in enumerate(examples):
                row, last = await self.one(client, example)
                rows.append(row)
                if self.options.progress:
                    print(
                        f"  {index + 1}/{len(examples)} {example.id}: retained {row.answer_retained}, "
                        f"shadow {row.dropped or 'compared'}",
                        flush=True,
                    )
        logged = read_shadow_log(log_path)
        for row in rows:
            fill_from_log(row, logged.get(row.request_id or ""))
        return rows, last.since(first)


def questions(options: AgreementOptions) -> tuple[str, list[EvalExample]]:
    dataset = load_dataset(resolve_dataset_path(options.dataset))
    return dataset.path, split_examples(dataset.examples, options.split)[: options.limit]


def run_shadow_agreement(options: AgreementOptions, out_dir: str | Path, command: str = "") -> dict[str, Any]:
    from ctxgate.eval.bench_e2e import model_name
    from ctxgate.eval.server import GatewayProcess

    dataset_path, examples = questions(options)
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    source = policy_source(options.policy, options.policy_dir)
    derived = shadowed_policy(source, options.policy, options.shadow_section())
    policies = write_policy_dir(target / "policies", options.policy_dir, [derived])
    log_path = target / "shadow.jsonl"
    log_path.unlink(missing_ok=True)
    started = time.perf_counter()
    gateway = GatewayProcess(
        policy_dir=policies,
        model=options.model,
        log_path=target / "gateway.log",
        extra_args=["--shadow-log", str(log_path)],
    )
    with gateway as url:
        run = AgreementRun(url, asyncio.run(model_name(url)), options)
        rows, counts = asyncio.run(run.run(examples, log_path))
    report: dict[str, Any] = {
        "schema": "ctxgate.shadow_agreement/v1",
        "command": command,
        "questions_from": dataset_path,
        "split": options.split,
        "policy": options.policy,
        "policy_source": str(source),
        "shadow": derived["shadow"],
        "comparison": derived["shadow"].get("comparison", "auto"),
        "max_tokens": options.max_tokens,
        "sampled": counts.sampled,
        "wall_s": round(time.perf_counter() - started, 1),
        "summary": summarize(rows, counts.dropped),
        "rows": rows_as_dicts(rows),
    }
    (target / "shadow_agreement.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
    (target / "shadow_agreement.md").write_text(render_markdown(report))
    return report
