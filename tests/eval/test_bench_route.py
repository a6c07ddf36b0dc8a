"""`ctxgate bench route`: the workloads share prefixes the way the
affinity key expects, arms never share one, and the figures and bars are computed as documented; one
request through a real gateway process in front of a real engine process."""

from __future__ import annotations

import asyncio

from ctxgate.eval.bench_route import (
    Outcome,
    bars,
    hits_gained,
    previous_turn_hits,
    render_markdown,
    summarize,
)
from ctxgate.eval.route_gateway import GatewayFront, gateway_config
from ctxgate.eval.route_workloads import multi_turn, rag
from ctxgate.gateway.affinity import affinity_key
from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import engine_processes


def key(item) -> str | None:
    return affinity_key("salt", item.messages, None, 2048)


def test_a_conversations_turns_share_its_key_and_grow_its_prefix():
    items = multi_turn("arm", conversations=3, turns=3, gap_s=5, start_every_s=1)
    assert [item.at_s for item in items] == sorted(item.at_s for item in items)
    by_conversation: dict[str, list] = {}
    for item in items:
        by_conversation.setdefault(item.conversation, []).append(item)
    assert len({key(turns[0]) for turns in by_conversation.values()}) == 3
    for turns in by_conversation.values():
        assert len({key(turn) for turn in turns}) == 1
        for earlier, later in zip(turns, turns[1:], strict=False):
            assert later.messages[: len(earlier.messages)] == earlier.messages  # the history is resent


def test_rag_requests_share_the_system_prompt_and_arms_share_nothing():
    first, second = rag("a", 4, 1.0), rag("b", 4, 1.0)
    assert len({item.messages[0]["content"] for item in first}) == 1
    assert first[0].messages[0]["content"] != second[0].messages[0]["content"]
    assert multi_turn("a", 1, 1, 1, 1)[0].messages[0]["content"].startswith("[a]")


def test_figures_lost_requests_and_bars():
    outcomes = [
        Outcome("multi-turn", 0.0, ttft_s=0.1, done_at=1.0),
        Outcome("multi-turn", 0.5, ttft_s=0.3, done_at=2.0),
        Outcome("multi-turn", 1.0, ttft_s=0.2, done_at=1.5, error="EngineError: cut"),
        Outcome("multi-turn", 1.0, done_at=1.2, error="EngineError: refused"),
    ]
    row = summarize(outcomes, 100.0)
    assert (row["requests"], row["failed"], row["failed_before_streaming"]) == (4, 2, 1)
    assert row["requests_per_s"] == 1.0 and row["ttft_ms_p50"] == 200.0
    assert hits_gained({"a": 10, "b": 5}, {"a": 30}) == 20  # b was killed: its counters are gone
    rr = summarize(outcomes[:2], 100.0)
    affinity = summarize(outcomes[:1], 250.0)
    report = {
        "arms": {"round robin": {"multi-turn": rr}, "affinity": {"multi-turn": affinity}},
        "kill": {"multi-turn": row},
    }
    assert bars(report) == {
        "hit_tokens_ratio": 2.5,
        "hit_tokens_2x": True,
        "ttft_p95_lower": True,
        "lost_before_streaming": 1,
    }
    report["bars"] = bars(report)
    assert (
        "| affinity, 1 replica killed | multi-turn | 4 | 2 (1 before streaming) | 100 |"
        in render_markdown(report)
    )


def test_previous_turn_reuse_is_counted_in_whole_blocks():
    def turn(conversation, index, prompt, cached):
        return Outcome(
            "multi-turn",
            0.0,
            ttft_s=0.1,
            done_at=1.0,
            turn=index,
            conversation=conversation,
            prompt_tokens=prompt,
            cached_tokens=cached,
        )

    done = [
        turn("a", 0, 40, 0),
        turn("a", 1, 100, 32),
        turn("a", 2, 170, 64),  # full, then partial (96 reusable)
        turn("b", 0, 50, 0),
        turn("b", 1, 90, 0),
    ]  # none of b's 48
    reuse = previous_turn_hits(done)["previous_turn"]
    assert reuse == {
        "reusable_tokens": 32 + 96 + 48,
        "found_tokens": 96,
        "found_share": round(96 / 176, 3),
        "turns": {"full": 1, "partial": 1, "none": 1},
    }
    assert previous_turn_hits([turn("a", 0, 40, 0)]) == {}  # no later turn: nothing to say


def test_the_gateway_config_puts_the_replicas_in_one_group_under_the_arm_strategy():
    config = gateway_config(["http://a:1", "http://b:2"], "cache_affinity", None)
    settings = GatewaySettings(**config["server"], model_list=config["model_list"])
    (group,) = settings.model_list
    assert group.routing == "cache_affinity" and [d.url for d in group.deployments] == [
        "http://a:1/v1",
        "http://b:2/v1",
    ]
    assert settings.default_policy == "passthrough"  # the replicas get the prompts as sent


def test_a_request_through_a_real_gateway_reports_the_replica_cache(model_dir, tmp_path):
    with engine_processes(model_dir, tmp_path, count=1) as engines:
        front = GatewayFront([url for url, _ in engines], "cache_affinity", tmp_path)
        try:
            front.wait_ready()
            item = multi_turn("t", 1, 1, 1, 1)[0]

            async def twice():
                try:
                    return [await front.send(item, 2), await front.send(item, 2)]
                finally:
                    await front.aclose()

            first, second = asyncio.run(twice())
        finally:
            front.stop()
    assert first["error"] is None and first["ttft_s"] > 0 and first["prompt_tokens"] > 16
    assert second["cached_tokens"] >= 16  # the same prompt again: its blocks were found on the replica
