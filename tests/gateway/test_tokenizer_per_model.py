"""Per-model tokenizers (`model_list[].tokenizer`): one gateway counts, renders and neutralises each
model's requests with that model's tokenizer. Real processes: the built-in SmolLM2 engine beside an
upstream `ctxgate engine serve` counted with tiktoken, and llama.cpp's `llama-server` serving the Qwen
GGUF counted with the GGUF's own tokenizer (whose count the server's own usage must agree with)."""

from __future__ import annotations

import pytest
import yaml
from openai import OpenAI

from ctxgate.gateway.app import create_app
from ctxgate.gateway.config_file import ConfigError, load_config
from ctxgate.gateway.settings import GatewaySettings
from ctxgate.gateway.tokenizer_spec import load_counting_tokenizer
from tests.support.servers import ServerThread, engine_processes, llama_server, llama_server_binary

MESSAGES = [
    {"role": "system", "content": "You are terse. Ünïcödé, emoji 🙂, code: `x = f(y) ** 2`."},
    {"role": "user", "content": "Name the capital of France in one word."},
]


def _usage(url: str, model: str, messages=MESSAGES) -> tuple[int, int, dict]:
    reply = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).chat.completions.create(
        model=model, messages=messages, max_tokens=2, temperature=0
    )
    extra = reply.usage.model_extra["ctxgate"]
    return extra["prompt_tokens"], reply.usage.prompt_tokens, extra


@pytest.fixture(scope="module")
def tiktoken_gateway(engine, model_dir, tmp_path_factory):
    """`local`: the built-in engine; `gpt`: an engine process, its budgets counted with cl100k_base."""
    tmp = tmp_path_factory.mktemp("model-tokenizers")
    with engine_processes(model_dir, tmp, count=1) as engines:
        model_list = [
            {"model_name": "local", "deployments": [{"engine": "builtin"}]},
            {
                "model_name": "gpt",
                "tokenizer": "cl100k_base",
                "deployments": [{"url": f"{url}/v1"} for url, _ in engines],
            },
        ]
        settings = GatewaySettings(model_list=model_list, default_policy="passthrough")
        with ServerThread(create_app(settings, engine=engine)) as running:
            yield running


def test_each_model_is_counted_with_its_own_tokenizer(tiktoken_gateway, tokenizer):
    local, local_upstream, local_extra = _usage(tiktoken_gateway.url, "local")
    gpt, _, gpt_extra = _usage(tiktoken_gateway.url, "gpt")
    cl100k = load_counting_tokenizer("cl100k_base")
    assert local == tokenizer.count_chat(MESSAGES) == local_upstream
    assert gpt == cl100k.count_chat(MESSAGES)
    assert gpt != local
    # The compression pipeline counted the request with the same tokenizer (its count before compression).
    assert local_extra["original_prompt_tokens"] == local and gpt_extra["original_prompt_tokens"] == gpt


def test_each_model_neutralises_its_own_special_tokens(tiktoken_gateway):
    # cl100k's `<|endoftext|>` would be one token if it stayed a control token; neutralised it is text.
    spelled = [{"role": "user", "content": "<|endoftext|>" * 20}]
    gpt, _, _ = _usage(tiktoken_gateway.url, "gpt", spelled)
    cl100k = load_counting_tokenizer("cl100k_base")
    assert gpt > cl100k.count_chat([{"role": "user", "content": "x" * 20}]) + 20


@pytest.mark.large_model
def test_a_qwen_group_is_counted_as_llama_server_counts_it(engine, tokenizer, qwen_gguf, tmp_path):
    binary = llama_server_binary()
    if binary is None:
        pytest.skip("$CTXGATE_LLAMA_SERVER is not set")
    with llama_server(binary, qwen_gguf, tmp_path / "llama.log", alias="qwen") as url:
        model_list = [
            {"model_name": "local", "deployments": [{"engine": "builtin"}]},
            {"model_name": "coder", "tokenizer": str(qwen_gguf), "deployments": [{"url": f"{url}/v1"}]},
        ]
        settings = GatewaySettings(model_list=model_list, default_policy="passthrough")
        with ServerThread(create_app(settings, engine=engine)) as running:
            local, _, _ = _usage(running.url, "local")
            coder, upstream, extra = _usage(running.url, "coder")
    qwen = load_counting_tokenizer(str(qwen_gguf))
    assert local == tokenizer.count_chat(MESSAGES)
    assert coder == qwen.count_chat(MESSAGES) == extra["original_prompt_tokens"]
    assert coder != local
    assert coder == upstream  # llama-server's own count of the prompt it rendered from the same GGUF


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"tokenizer": "/nowhere/model.gguf"}, "no such GGUF file"),
        ({"tokenizer": "./no-such-dir"}, "not a directory with a tokenizer.json"),
        ({"tokenizer": "cl100k_typo"}, "neither a GGUF file"),
        (
            {"tokenizer": "cl100k_base", "deployments": [{"engine": "builtin"}]},
            "counts with its own tokenizer",
        ),
    ],
)
def test_a_bad_tokenizer_is_a_config_error(tmp_path, entry, message):
    path = tmp_path / "ctxgate.yaml"
    model = {"model_name": "chat", "deployments": [{"url": "http://a:1"}]} | entry
    path.write_text(yaml.safe_dump({"model_list": [model]}))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_relative_tokenizer_path_is_relative_to_the_config_file(tmp_path, model_dir):
    (tmp_path / "smol").symlink_to(model_dir, target_is_directory=True)
    path = tmp_path / "ctxgate.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model_list": [
                    {"model_name": "chat", "tokenizer": "smol", "deployments": [{"url": "http://a:1"}]},
                    {"model_name": "gpt", "tokenizer": "cl100k_base", "deployments": [{"url": "http://b:1"}]},
                ]
            }
        )
    )
    chat, gpt = load_config(path).model_list
    assert chat.tokenizer == str(tmp_path / "smol") and gpt.tokenizer == "cl100k_base"
