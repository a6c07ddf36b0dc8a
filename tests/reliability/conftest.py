"""Fixtures for the reliability suite: one small engine for the whole suite, gateways around it.

The engine has a deliberately tiny KV pool and few sequence slots so that overload, preemption and
queueing are reached with a handful of short requests on two CPU cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.servers import write_policy

MODEL_NAME = "SmolLM2-135M-Instruct"
# 24 blocks x 16 tokens = 384 tokens of KV for everything running at once.
NUM_KV_BLOCKS = 24
BLOCK_SIZE = 16
MAX_MODEL_LEN = NUM_KV_BLOCKS * BLOCK_SIZE

# Budget-only policy (no embeddings, no summarization calls) with a small output reserve.
RELIABILITY_POLICY = (
    "name: rel\nmax_input_tokens: 256\nreserve_output_tokens: 8\ncompression_enabled: false\n"
    "history: {enabled: false, max_tokens: 256}\ndocuments: {max_tokens: 200}\ndedup: {enabled: false}\n"
    "rerank: {enabled: false}\nextraction: {enabled: false}\nassembly: {order: original, placement: user}\n"
)


def small_engine_config(model_dir, **overrides):
    from ctxgate.backend.engine.config import EngineConfig

    fields = dict(
        model=str(model_dir),
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        num_threads=1,
    )
    fields.update(overrides)
    return EngineConfig(**fields)


@pytest.fixture(scope="session")
def small_engine(model_dir):
    from ctxgate.backend.engine.async_engine import AsyncEngine

    engine = AsyncEngine(small_engine_config(model_dir), max_waiting_requests=4)
    yield engine
    engine.shutdown()


def policy_dir(root: Path, text: str = RELIABILITY_POLICY) -> Path:
    directory = root / "policies"
    directory.mkdir(exist_ok=True)
    write_policy(directory, "rel", text)
    return directory


def gateway_settings(root: Path, **overrides):
    from ctxgate.gateway.settings import GatewaySettings

    fields = dict(
        policy_dir=policy_dir(root),
        default_policy="rel",
        include_packaged_policies=False,
        reload_interval_s=0.3,
        max_in_flight=4,
        max_queued=4,
        queue_timeout_s=2.0,
        request_timeout_s=60.0,
    )
    fields.update(overrides)
    return GatewaySettings(**fields)


def chat_body(content: str = "Say hi.", max_tokens: int = 4, **extra) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
