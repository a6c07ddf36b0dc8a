"""`ctxgate serve --model <qwen gguf>`: the real process answers the OpenAI SDK, and the gateway
counts budgets with the served model's own tokenizer and chat template (not SmolLM2's)."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.support.servers import ctxgate_process, free_port, wait_http

pytestmark = pytest.mark.large_model

PASSAGE = "The Eiffel Tower in Paris was completed in 1889 for the World's Fair. " * 6


def test_serve_gguf_counts_with_the_served_tokenizer(qwen_gguf, qwen_dir, tmp_path):
    from ctxgate.backend.model.tokenizer import load_tokenizer

    qwen = load_tokenizer(str(qwen_dir))
    port = free_port()
    args = [
        "serve",
        "--model",
        str(qwen_gguf),
        "--port",
        str(port),
        "--num-threads",
        "1",
        "--kv-cache-memory-mb",
        "16",
    ]
    with ctxgate_process(args, tmp_path / "serve.log"):
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/ready", timeout_s=300)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert client.models.list().data[0].id == qwen_gguf.stem
        messages = [{"role": "user", "content": "When was the Eiffel Tower completed?"}]
        documents = [{"id": f"d{i}", "title": f"Doc {i}", "text": PASSAGE} for i in range(4)]
        reply = client.chat.completions.create(
            model=qwen_gguf.stem,
            messages=messages,
            max_tokens=4,
            temperature=0,
            extra_body={"ctxgate": {"documents": documents, "policy": "rag-default"}},
        )
        ctx = reply.usage.model_extra["ctxgate"]
        assert reply.usage.prompt_tokens == ctx["prompt_tokens"]  # the engine prefilled what was counted
        body = {
            "model": qwen_gguf.stem,
            "messages": messages,
            "ctxgate": {"documents": documents, "policy": "rag-default"},
        }
        report = httpx.post(f"{url}/v1/ctxgate/compress", json=body, timeout=120).json()
        assert (
            qwen.count_chat(report["messages"]) == report["report"]["prompt_tokens"] == ctx["prompt_tokens"]
        )
