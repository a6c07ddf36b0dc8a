"""The engine on a CUDA GPU: greedy parity with Hugging Face, prefix caching, preemption, aborts
and disconnects, the Triton kernel on GPU tensors, CUDA graphs, the KV pool sized from GPU memory.

Marked `cuda` and skipped without a GPU; eval/gpu_check.sh runs them with `pytest -m cuda`. What
does not need a GPU is tested on CPU in test_attention_cuda.py.
"""

from __future__ import annotations

import asyncio
import gc
import uuid

import pytest
import torch

from ctxgate.backend.engine.api import GenerationRequest, SamplingParams
from tests.backend.engine_fixtures import PARITY_MAX_TOKENS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = SamplingParams(max_tokens=PARITY_MAX_TOKENS, temperature=0.0, ignore_eos=True)
SHARED_PREFIX = (
    "You are a helpful assistant. Answer the question using only the context below.\n"
    "Context: The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower.\n"
)


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Engines of earlier tests hold KV pools; free them so memory-sizing sees this test's own."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _agreement(first: list[list[int]], second: list[list[int]]) -> float:
    same = sum(a == b for x, y in zip(first, second, strict=True) for a, b in zip(x, y, strict=True))
    return same / sum(len(x) for x in second)


def test_device_auto_runs_the_cuda_path(make_engine):
    engine = make_engine(device="auto", dtype="auto")
    info = engine.path_info()
    assert engine.device.type == "cuda" and engine.dtype == torch.bfloat16
    assert engine.attention.name == "cuda" and info["attention"] == "cuda"
    assert engine.kv_cache.keys[0].is_cuda and engine.model.embed_tokens.weight.is_cuda
    assert info["decode_kernel"] == "triton", "install triton (pip install 'ctxgate[gpu]')"
    graphs = engine.runner.decode_graphs
    assert graphs is not None and sorted(graphs.graphs) == list(info["cuda_graph_batch_sizes"])
    assert not engine.model.use_fused_layers and engine.model.lm_head.gemv_max_rows == 0  # no CPU kernels


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_float32_greedy_matches_hf(make_engine, parity_prompts, hf_greedy_reference, cuda_graphs):
    engine = make_engine(device="cuda", cuda_graphs=cuda_graphs)
    assert (engine.runner.decode_graphs is not None) == cuda_graphs
    for prompt, expected in zip(parity_prompts, hf_greedy_reference, strict=True):
        assert engine.generate([prompt], GREEDY) == [expected]
    assert engine.generate(parity_prompts, GREEDY) == hf_greedy_reference
    assert engine.stats().num_kv_blocks_free == engine.stats().num_kv_blocks_total


def test_graph_batches_of_every_padding_match_hf(make_engine, parity_prompts, hf_greedy_reference):
    """Prompts finish at different steps, so decode batches shrink through padded sizes 8..1."""
    engine = make_engine(device="cuda", cuda_graphs=True)
    budgets = [PARITY_MAX_TOKENS - (i % 6) for i in range(len(parity_prompts))]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in budgets]
    outputs = engine.generate(parity_prompts, params)
    assert outputs == [expected[:n] for expected, n in zip(hf_greedy_reference, budgets, strict=True)]


def test_small_prefill_chunks_match_hf(make_engine, parity_prompts, hf_greedy_reference):
    """Chunks attend to their cached prefix through the lower-right causal SDPA."""
    engine = make_engine(device="cuda", max_num_batched_tokens=16)
    assert engine.generate(parity_prompts, GREEDY) == hf_greedy_reference


def test_preemption_under_a_tiny_kv_pool_matches_hf(make_engine, parity_prompts, hf_greedy_reference):
    longest = max(len(p) for p in parity_prompts) + PARITY_MAX_TOKENS
    num_blocks = -(-longest // 16) + 2
    engine = make_engine(device="cuda", num_kv_blocks=num_blocks, enable_prefix_caching=False)
    assert engine.generate(parity_prompts, GREEDY) == hf_greedy_reference
    assert engine.stats().num_preemptions > 0
    assert engine.stats().num_kv_blocks_free == num_blocks


def test_bfloat16_agrees_with_hf_bfloat16_on_the_gpu(make_engine, model_dir, parity_prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to("cuda").eval()
    reference = []
    with torch.inference_mode():
        for prompt in parity_prompts:
            generated = model.generate(
                torch.tensor([prompt], device="cuda"),
                attention_mask=torch.ones(1, len(prompt), device="cuda"),
                max_new_tokens=PARITY_MAX_TOKENS,
                min_new_tokens=PARITY_MAX_TOKENS,
                do_sample=False,
                pad_token_id=model.config.eos_token_id,
            )
            reference.append(generated[0, len(prompt) :].tolist())
    del model
    engine = make_engine(device="cuda", dtype="bfloat16")
    # bf16 sums in another order (other kernels) can flip a near-tie; nearly all must agree.
    assert _agreement(engine.generate(parity_prompts, GREEDY), reference) >= 0.9


def test_prefix_cache_hit_gives_identical_output(make_engine, tokenizer):
    engine = make_engine(device="cuda")
    prompt = tokenizer.encode(SHARED_PREFIX + "Question: Who designed the tower?\nAnswer:")
    first = engine.generate([prompt], GREEDY)
    hits_before = engine.stats().prefix_cache_hit_tokens
    second = engine.generate([prompt], GREEDY)
    assert engine.stats().prefix_cache_hit_tokens - hits_before >= 32
    assert second == first
    uncached = make_engine(device="cuda", enable_prefix_caching=False)
    assert uncached.generate([prompt], GREEDY) == first


def test_abort_mid_prefill_and_mid_decode_frees_every_block(make_engine, tokenizer):
    engine = make_engine(device="cuda", max_num_batched_tokens=16)
    total = engine.stats().num_kv_blocks_total
    engine.add_request(GenerationRequest("prefilling", tokenizer.encode(SHARED_PREFIX), GREEDY))
    engine.step()
    engine.abort_request("prefilling")
    engine.add_request(GenerationRequest("decoding", tokenizer.encode("Hello there"), GREEDY))
    engine.step()
    engine.step()
    engine.abort_request("decoding")
    assert engine.step() == []
    assert engine.stats().num_kv_blocks_free == total and not engine.has_unfinished_requests()


def test_client_disconnect_frees_blocks(model_dir):
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig
    from tests.support.waiting import wait_until_engine_idle

    engine = AsyncEngine(
        EngineConfig(model=str(model_dir), device="cuda", kv_cache_memory_mb=64, max_model_len=1024)
    )
    try:
        request = GenerationRequest(
            uuid.uuid4().hex,
            engine.tokenizer.encode("A long tale:"),
            SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True),
        )

        async def leave_after_first_delta() -> None:
            stream = engine.generate(request)
            await stream.__anext__()
            await stream.aclose()  # what a disconnecting HTTP client does to the server's generator

        asyncio.run(leave_after_first_delta())
        wait_until_engine_idle(engine)
    finally:
        engine.shutdown()


def test_seeded_sampling_on_the_gpu_is_reproducible(make_engine, tokenizer):
    engine = make_engine(device="cuda")
    prompt = tokenizer.encode("Write a word:")

    def sampled(seed: int) -> list[int]:
        params = SamplingParams(
            max_tokens=8, temperature=1.0, top_k=50, top_p=0.9, seed=seed, ignore_eos=True
        )
        return engine.generate([prompt], params)[0]

    assert sampled(1) == sampled(1)
    assert sampled(1) != sampled(2) or sampled(3) != sampled(1)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int8"])
def test_triton_kernel_on_gpu_matches_the_gathered_reference(name):
    from ctxgate.backend.model import triton_paged_attention
    from ctxgate.backend.model.attention import gathered_decode_attention
    from ctxgate.backend.model.attention_cuda import padding_bias
    from ctxgate.backend.model.kv_cache import KVCache
    from tests.backend.test_attention_cuda import TRITON_CASES, _paged_cache

    dtype, quantized, tolerance = TRITON_CASES[name]
    cpu_cache, tables, lengths, q = _paged_cache(dtype, quantized, [1, 16, 17, 40, 100, 700])
    cache = KVCache(cpu_cache.spec, cpu_cache.num_blocks, torch.device("cuda"))
    for layer_tensors, cpu_tensors in ((cache.keys, cpu_cache.keys), (cache.values, cpu_cache.values)):
        layer_tensors[0].copy_(cpu_tensors[0])
    if quantized:
        cache.key_scales[0].copy_(cpu_cache.key_scales[0])
        cache.value_scales[0].copy_(cpu_cache.value_scales[0])
    tables, lengths, q = tables.cuda(), lengths.cuda(), q.cuda()
    out = triton_paged_attention.paged_decode_attention(
        q,
        cache.keys[0],
        cache.values[0],
        cache.key_scales[0] if quantized else None,
        cache.value_scales[0] if quantized else None,
        tables,
        lengths,
        16,
        0.125,
    )
    reference = gathered_decode_attention(
        q, cache, 0, tables, padding_bias(lengths, tables.shape[1] * 16), 3, 0.125
    )
    torch.testing.assert_close(out.float(), reference.float(), atol=tolerance, rtol=tolerance)


def test_kv_pool_is_sized_from_free_gpu_memory(make_engine):
    gc.collect()
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    engine = make_engine(
        device="cuda", kv_cache_memory_mb=None, gpu_memory_utilization=0.3, max_model_len=2048
    )
    spec = engine.kv_cache.spec
    pool_bytes = engine.block_manager.num_blocks * spec.bytes_per_block
    free_after, _ = torch.cuda.mem_get_info()
    assert pool_bytes > 0.1 * total  # most of the 30% budget went to the pool (the model is small)
    assert total - free_after <= 0.3 * total + 2**30, "the engine must stay within its utilization (+1 GiB)"
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert free_before - free_after >= pool_bytes  # the pool is really allocated on the GPU
