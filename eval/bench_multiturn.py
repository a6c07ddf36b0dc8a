"""`ctxgate bench multiturn`: multi-turn RAG conversations, compressed as today vs with conversation
memory (`conversation.enabled`), interleaved in one run on the built-in engine.

Conversations are built from a dev set: each turn asks another example's question with that
example's passages (its gold ones first, a few others) plus passages retrieved again from the turn
before (its gold passage first), as a RAG chat's follow-ups retrieve some of the same passages;
the model's answer of each turn goes into the next turn's history. Several conversations run at once;
per turn round, the arms take turns (in alternating order), each arm's requests concurrent, so the
engine's prefix-cache counters (`/metrics`) over that round belong to that arm. Each arm has a
system prompt of its own (the arms never share cache blocks). Reported per turn and arm: prefix-cache
hit tokens, TTFT P50/P95 (streamed, client side), prompt tokens sent, and answer retention (the gold
answer in the sent prompt, from a replay of the same conversations through /v1/ctxgate/compress).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command's flags are registered with the CLI's: the rest loads when it runs
    import httpx

    from ctxgate.eval.datasets import EvalExample

ARMS = ("today", "memory")


@dataclass(frozen=True)
class Turn:
    question: str
    answers: tuple[str, ...]
    documents: list[dict[str, str]]


@dataclass
class ArmTurn:
    """One arm's measurements of one turn round."""

    ttft_ms: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    hits: float = 0.0
    queries: float = 0.0
    retained: list[bool] = field(default_factory=list)
    sentences_dropped: int = 0
    errors: int = 0
    compression_ms: list[float] = field(default_factory=list)  # the gateway's, from usage.ctxgate


def build_conversations(
    examples: list[EvalExample], conversations: int, turns: int, own: int = 3, carried: int = 2, seed: int = 0
) -> list[list[Turn]]:
    """`conversations` conversations of `turns` turns; turn t holds its example's gold passages and
    others (`own` in all) and `carried` passages of turn t-1 (its gold first), shuffled."""
    rng = random.Random(seed)
    out: list[list[Turn]] = []
    for c in range(conversations):
        chosen = examples[c * turns : (c + 1) * turns]
        conversation: list[Turn] = []
        previous: list[Any] = []
        for example in chosen:
            mine = sorted(example.passages, key=lambda p: not p.is_gold)[:own]
            again = previous[:carried]
            passages = mine + [p for p in again if p not in mine]
            rng.shuffle(passages)
            documents = [{"id": f"p{i}", "title": p.title, "text": p.text} for i, p in enumerate(passages)]
            conversation.append(Turn(example.question, example.answers, documents))
            previous = mine
        out.append(conversation)
    return out


def arm_policies(policy: str, max_input_tokens: int) -> dict[str, dict[str, Any]]:
    """The packaged policy, the same budget in both arms; the memory arm remembers conversations."""
    import yaml

    from ctxgate.policies.loader import packaged_policy_dir

    base = yaml.safe_load((packaged_policy_dir() / f"{policy}.yaml").read_text())
    base["max_input_tokens"] = max_input_tokens
    base["assembly"] = {**(base.get("assembly") or {}), "placement": "user"}
    today = {**base, "name": f"{policy}-mt-today"}
    memory = {**base, "name": f"{policy}-mt-memory", "conversation": {"enabled": True}}
    return {"today": today, "memory": memory}


@dataclass
class StreamedReply:
    text: str
    ttft_ms: float | None = None
    prompt_tokens: int | None = None
    compression_ms: float | None = None


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any]) -> StreamedReply:
    """One streamed chat completion: its reply, TTFT, prompt tokens and the gateway's compression time."""
    started = time.perf_counter()
    ttft: float | None = None
    pieces: list[str] = []
    prompt_tokens: int | None = None
    compression_ms: float | None = None
    async with client.stream(
        "POST",
        "/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
                compression_ms = (chunk["usage"].get("ctxgate") or {}).get("compression_ms_total")
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    ttft = ttft if ttft is not None else (time.perf_counter() - started) * 1000
                    pieces.append(text)
    return StreamedReply("".join(pieces), ttft, prompt_tokens, compression_ms)


def system_message(arm: str) -> dict[str, str]:
    from ctxgate.eval.client import SYSTEM_PROMPT

    return {"role": "system", "content": f"[app {arm}] {SYSTEM_PROMPT}"}


async def run_chats(
    url: str, model: str, conversations: list[list[Turn]], policies: dict[str, str], max_tokens: int
) -> tuple[dict[str, list[ArmTurn]], dict[str, list[list[str]]]]:
    """The turn rounds, arms interleaved; returns per arm the turns' measurements and the replies."""
    import httpx

    from ctxgate.eval.bench_prefix import prefix_counters

    turns = max(len(c) for c in conversations)
    rows = {arm: [ArmTurn() for _ in range(turns)] for arm in policies}
    histories = {arm: [[system_message(arm)] for _ in conversations] for arm in policies}
    replies: dict[str, list[list[str]]] = {arm: [[] for _ in conversations] for arm in policies}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(arm: str, c: int, turn: Turn, row: ArmTurn) -> None:
            messages = histories[arm][c] + [{"role": "user", "content": turn.question}]
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ctxgate": {"documents": turn.documents, "policy": policies[arm]},
            }
            try:
                reply = await stream_chat(client, body)
            except httpx.HTTPError:
                row.errors += 1
                reply = StreamedReply("")
            if reply.ttft_ms is not None:
                row.ttft_ms.append(reply.ttft_ms)
            if reply.prompt_tokens is not None:
                row.prompt_tokens.append(reply.prompt_tokens)
            if reply.compression_ms is not None:
                row.compression_ms.append(reply.compression_ms)
            histories[arm][c] = messages + [
                {"role": "assistant", "content": reply.text.strip() or "I don't know."}
            ]
            replies[arm][c].append(histories[arm][c][-1]["content"])

        for t in range(turns):
            order = list(policies) if t % 2 == 0 else list(policies)[::-1]
            for arm in order:
                before = prefix_counters((await client.get("/metrics")).text)
                await asyncio.gather(
                    *(
                        one(arm, c, conv[t], rows[arm][t])
                        for c, conv in enumerate(conversations)
                        if t < len(conv)
                    )
                )
                after = prefix_counters((await client.get("/metrics")).text)
                rows[arm][t].hits = after["hits"] - before["hits"]
                rows[arm][t].queries = after["queries"] - before["queries"]
    return rows, replies


async def replay_retention(
    url: str,
    model: str,
    conversations: list[list[Turn]],
    policies: dict[str, str],
    replies: dict[str, list[list[str]]],
    rows: dict[str, list[ArmTurn]],
) -> None:
    """The same conversations (the arms' own replies as history) through /v1/ctxgate/compress, under
    a system prompt of their own (a conversation of its own in the memory arm): is each turn's gold
    answer in what would be sent?"""
    import httpx

    from ctxgate.eval.client import SYSTEM_PROMPT
    from ctxgate.eval.evidence import messages_text
    from ctxgate.eval.metrics import answer_in_text

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for arm, policy in policies.items():
            for c, conversation in enumerate(conversations):
                messages = [{"role": "system", "content": f"[replay {arm}] {SYSTEM_PROMPT}"}]
                for t, turn in enumerate(conversation):
                    messages.append({"role": "user", "content": turn.question})
                    body = {
                        "model": model,
                        "messages": messages,
                        "ctxgate": {"documents": turn.documents, "policy": policy},
                    }
                    response = await client.post("/v1/ctxgate/compress", json=body)
                    response.raise_for_status()
                    payload = response.json()
                    rows[arm][t].retained.append(
                        answer_in_text(messages_text(payload["messages"]), turn.answers)
                    )
                    for stage in payload["report"]["stages"]:
                        if stage["name"] == "conversation":
                            rows[arm][t].sentences_dropped += stage["details"].get(
                                "sent_sentences_dropped", 0
                            )
                    messages.append({"role": "assistant", "content": replies[arm][c][t]})


def summarise(rows: dict[str, list[ArmTurn]]) -> dict[str, list[dict[str, Any]]]:
    from ctxgate.eval.stats import percentile

    def mean(values: list[float] | list[int]) -> float | None:
        return round(sum(values) / len(values), 1) if values else None

    return {
        arm: [
            {
                "turn": t + 1,
                "requests": len(row.prompt_tokens) + row.errors,
                "prefix_hit_tokens": row.hits,
                "prefix_lookup_tokens": row.queries,
                "ttft_p50_ms": round(percentile(row.ttft_ms, 50), 1) if row.ttft_ms else None,
                "ttft_p95_ms": round(percentile(row.ttft_ms, 95), 1) if row.ttft_ms else None,
                "ttft_ms": [round(ttft, 1) for ttft in row.ttft_ms],
                "compression_ms_p50": round(percentile(row.compression_ms, 50), 1)
                if row.compression_ms
                else None,
                "prompt_tokens_mean": mean(row.prompt_tokens),
                # What the engine had to prefill: the prompt tokens its prefix cache did not hold.
                "uncached_tokens_mean": round((row.queries - row.hits) / len(row.prompt_tokens), 1)
                if row.prompt_tokens
                else None,
                "retention": round(sum(row.retained) / len(row.retained), 4) if row.retained else None,
                "sentences_not_resent": row.sentences_dropped,
                "errors": row.errors,
            }
            for t, row in enumerate(arm_rows)
        ]
        for arm, arm_rows in rows.items()
    }


def totals(per_turn: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Across turns: hit tokens; over turns >= 2, the TTFT P50/P95 of all their requests, the worst
    per-turn P95 and the mean prompt tokens; retention over every turn."""
    from ctxgate.eval.stats import percentile

    out = {}
    for arm, turns in per_turn.items():
        later = [t for t in turns if t["turn"] >= 2]
        retained = [t["retention"] for t in turns if t["retention"] is not None]
        later_ttfts = [ttft for t in later for ttft in t["ttft_ms"]]
        out[arm] = {
            "prefix_hit_tokens": sum(t["prefix_hit_tokens"] for t in turns),
            "prefix_lookup_tokens": sum(t["prefix_lookup_tokens"] for t in turns),
            "ttft_p50_ms_turns_2_plus": round(percentile(later_ttfts, 50), 1) if later_ttfts else None,
            "ttft_p95_ms_turns_2_plus": round(percentile(later_ttfts, 95), 1) if later_ttfts else None,
            "worst_turn_ttft_p95_ms": max((t["ttft_p95_ms"] or 0 for t in later), default=None),
            "prompt_tokens_mean_turns_2_plus": round(
                sum(t["prompt_tokens_mean"] or 0 for t in later) / len(later), 1
            )
            if later
            else None,
            "uncached_tokens_mean_turns_2_plus": round(
                sum(t["uncached_tokens_mean"] or 0 for t in later) / len(later), 1
            )
            if later
            else None,
            "retention": round(sum(retained) / len(retained), 4) if retained else None,
        }
    return out


def run_bench_multiturn(
    dataset: str,
    policy: str,
    conversations: int,
    turns: int,
    max_input_tokens: int,
    max_tokens: int,
    out_dir: str | Path,
    model: str | None = None,
) -> dict[str, Any]:
    import httpx
    import yaml

    from ctxgate.eval.datasets import load_dataset, resolve_dataset_path
    from ctxgate.eval.report import cpu_path_line
    from ctxgate.eval.server import GatewayProcess

    target = Path(out_dir)
    policy_dir = target / "policies"
    policy_dir.mkdir(parents=True, exist_ok=True)
    names = {}
    for arm, body in arm_policies(policy, max_input_tokens).items():
        (policy_dir / f"{body['name']}.yaml").write_text(yaml.safe_dump(body))
        names[arm] = body["name"]
    data = load_dataset(resolve_dataset_path(dataset), limit=conversations * turns)
    built = build_conversations(data.examples, conversations, turns)
    with GatewayProcess(
        policy_dir=policy_dir,
        model=model,
        log_path=target / "gateway.log",
        env={"REDIS_URL": None, "CTXGATE_EMBED_CACHE_URL": None},
    ) as url:
        model_name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        rows, replies = asyncio.run(run_chats(url, model_name, built, names, max_tokens))
        asyncio.run(replay_retention(url, model_name, built, names, replies, rows))
    per_turn = summarise(rows)
    report = {
        "schema": "ctxgate.bench_multiturn/v1",
        "dataset": data.path,
        "policy": policy,
        "conversations": len(built),
        "turns": turns,
        "max_input_tokens": max_input_tokens,
        "max_tokens": max_tokens,
        "cpu_path": cpu_path_line(),
        "per_turn": per_turn,
        "totals": totals(per_turn),
    }
    (target / "bench_multiturn.json").write_text(json.dumps(report, indent=2))
    (target / "bench_multiturn.md").write_text(render_markdown(report))
    return report


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Multi-turn RAG: today vs conversation memory (`{report['policy']}`)",
        "",
        f"- Dataset `{report['dataset']}`; {report['conversations']} conversations at once, "
        f"{report['turns']} turns, max_input_tokens {report['max_input_tokens']}, "
        f"{report['max_tokens']} output tokens; arms interleaved per turn round",
        f"- CPU path: {report['cpu_path']}",
        "",
        "| arm | turn | prefix hit tokens | looked up | TTFT P50 ms | TTFT P95 ms | compression P50 ms | prompt tokens | not cached | retention | sentences not resent |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, turns in report["per_turn"].items():
        for t in turns:
            lines.append(
                f"| {arm} | {t['turn']} | {t['prefix_hit_tokens']:.0f} | {t['prefix_lookup_tokens']:.0f} | "
                f"{t['ttft_p50_ms']} | {t['ttft_p95_ms']} | {t['compression_ms_p50']} | {t['prompt_tokens_mean']} | {t['uncached_tokens_mean']} | {t['retention']} | "
                f"{t['sentences_not_resent']} |"
            )
    lines += [
        "",
        "| arm | hit tokens | looked up | TTFT P50 / P95, turns >= 2 | worst turn's TTFT P95 | prompt tokens, turns >= 2 | not cached, turns >= 2 | retention |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, row in report["totals"].items():
        lines.append(
            f"| {arm} | {row['prefix_hit_tokens']:.0f} | {row['prefix_lookup_tokens']:.0f} | "
            f"{row['ttft_p50_ms_turns_2_plus']} / {row['ttft_p95_ms_turns_2_plus']} | "
            f"{row['worst_turn_ttft_p95_ms']} | {row['prompt_tokens_mean_turns_2_plus']} | "
            f"{row['uncached_tokens_mean_turns_2_plus']} | {row['retention']} |"
        )
    return "\n".join(lines) + "\n"


def register(bench_sub: argparse._SubParsersAction) -> None:
    """`ctxgate bench multiturn` and its flags."""
    parser = bench_sub.add_parser(
        "multiturn",
        help="multi-turn RAG conversations: prefix-cache hits, TTFT, prompt tokens and retention per "
        "turn, today's compression vs conversation memory",
    )
    parser.add_argument(
        "--input",
        dest="dataset",
        default="nq-multidoc-dev.jsonl",
        help="QA JSONL (default nq-multidoc-dev.jsonl)",
    )
    parser.add_argument(
        "--policy", default="rag-default", help="packaged compressing policy (default rag-default)"
    )
    parser.add_argument("--conversations", type=int, default=4, help="conversations at once (default 4)")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation, 4 to 8 (default 6)")
    parser.add_argument(
        "--max-input-tokens", type=int, default=4096, help="both arms' prompt budget (default 4096)"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per turn (default 16)")
    parser.add_argument("--model", help="model directory for the gateway (default: the default model)")
    parser.add_argument(
        "--out", default="bench-out/multiturn", help="output directory (default bench-out/multiturn)"
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from ctxgate.eval.cli_common import quiet_http_logs

    quiet_http_logs()
    if args.conversations <= 0 or not 1 <= args.turns <= 16:
        raise ValueError("--conversations must be positive and --turns between 1 and 16")
    report = run_bench_multiturn(
        args.dataset,
        args.policy,
        args.conversations,
        args.turns,
        args.max_input_tokens,
        args.max_tokens,
        args.out,
        args.model,
    )
    print(render_markdown(report))
    return 0
