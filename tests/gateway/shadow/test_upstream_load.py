"""Reading an upstream's queue and KV cache use from the /metrics texts vLLM and SGLang serve."""

from __future__ import annotations

from ctxgate.gateway.shadow.upstream_load import parse_load

VLLM = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
"""
SGLANG = """# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 0.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.1
"""


def test_vllm_queues_add_up_and_the_fullest_kv_cache_counts():
    assert parse_load(VLLM) == (3.0, 0.5)


def test_sglang_and_a_server_without_a_queue_metric():
    assert parse_load(SGLANG) == (0.0, 0.1)
    assert parse_load("# TYPE up gauge\nup 1\n") is None  # no queue: the load is unknown
