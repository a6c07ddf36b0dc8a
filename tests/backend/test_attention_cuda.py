"""The CUDA path's device-independent parts, on CPU: backend choice and start-up errors, the Triton
paged-decode kernel under Triton's CPU interpreter, the CUDA backend's prefill/decode code with its
torch fallback, the padded static-buffer decode that CUDA graphs replay, and the KV pool sizing."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ctxgate.backend.engine.api import SamplingParams
from ctxgate.backend.engine.config import EngineConfig
from ctxgate.backend.engine.model_runner import ModelRunner
from ctxgate.backend.engine.scheduler import ScheduledSequence
from ctxgate.backend.engine.sequence import Sequence
from ctxgate.backend.engine.startup import check_device_support, resolve_device, use_decode_graphs
from ctxgate.backend.model.attention import (
    AttentionMetadata,
    CPUBatchedAttention,
    create_backend,
    default_backend_name,
    gathered_decode_attention,
    resolve_backend_name,
)
from ctxgate.backend.model.attention_cuda import CUDAAttention, padding_bias
from ctxgate.backend.model.decode_graphs import (
    DecodeBatch,
    DecodeGraphs,
    DecodeInputBuffers,
    capture_sizes,
    padded_batch_size,
)
from ctxgate.backend.model.kv_cache import (
    KVCache,
    KVCacheSpec,
    activation_reserve_bytes,
    kv_blocks_for_gpu_memory,
)
from tests.backend.engine_fixtures import PARITY_MAX_TOKENS

GREEDY = SamplingParams(max_tokens=PARITY_MAX_TOKENS, temperature=0.0, ignore_eos=True)
CPU = torch.device("cpu")
CUDA = torch.device("cuda")
REPO_ROOT = Path(__file__).resolve().parents[2]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without a GPU")


# ---------------------------------------------------------------- backend choice, start-up errors
def test_auto_backend_is_cuda_on_a_gpu_and_cpu_batched_on_cpu():
    assert default_backend_name(CUDA) == "cuda"
    assert default_backend_name(CPU) == "cpu_batched"
    assert resolve_backend_name("auto", CUDA) == "cuda"
    assert resolve_backend_name("reference", CUDA) == "reference"


def test_cuda_backend_on_cpu_is_a_clear_startup_error(make_engine):
    with pytest.raises(ValueError, match="runs on cuda devices only.*cpu"):
        create_backend("cuda", CPU, 9, 3, 64)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        resolve_backend_name("flash", CPU)
    started = time.perf_counter()
    with pytest.raises(ValueError, match="runs on cuda devices only"):
        make_engine(device="cpu", attention_backend="cuda")
    assert time.perf_counter() - started < 5, "refused before loading the weights"


@no_gpu
def test_device_cuda_without_a_gpu_is_a_clear_startup_error():
    with pytest.raises(ValueError, match="sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="sees no CUDA device"):
        resolve_device("cuda:1")
    assert resolve_device("auto") == CPU


def test_device_auto_picks_cuda_when_torch_sees_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == CPU


def test_paths_the_device_lacks_are_refused():
    with pytest.raises(ValueError, match="int4 runs on CPU only"):
        check_device_support(EngineConfig(weight_quant="int4"), CUDA)
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device"):
        check_device_support(EngineConfig(cuda_graphs=True), CPU)
    check_device_support(EngineConfig(), CPU)  # the defaults run anywhere
    check_device_support(EngineConfig(), CUDA)


def test_decode_graphs_default_on_for_the_cuda_backend_only():
    cuda_backend = CUDAAttention(9, 3, 64, decode_kernel="torch")
    reference = create_backend("reference", CPU, 9, 3, 64)
    assert use_decode_graphs(EngineConfig(), CUDA, cuda_backend)
    assert not use_decode_graphs(EngineConfig(cuda_graphs=False), CUDA, cuda_backend)
    assert not use_decode_graphs(EngineConfig(), CPU, reference)
    assert not use_decode_graphs(EngineConfig(kv_cache_dtype="int8"), CUDA, cuda_backend)
    with pytest.raises(ValueError, match="int8 KV writes"):
        use_decode_graphs(EngineConfig(cuda_graphs=True, kv_cache_dtype="int8"), CUDA, cuda_backend)
    with pytest.raises(ValueError, match="has no static-shape decode"):
        use_decode_graphs(EngineConfig(cuda_graphs=True), CUDA, reference)


def test_cli_flags_reach_the_config():
    from ctxgate.backend.serving.cli import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(
        parser.parse_args(["--gpu-memory-utilization", "0.5", "--no-cuda-graphs"])
    )
    assert config.gpu_memory_utilization == 0.5 and config.cuda_graphs is False
    defaults = engine_config_from_args(parser.parse_args([]))
    assert defaults.gpu_memory_utilization == 0.9 and defaults.cuda_graphs is None
    assert defaults.kv_cache_memory_mb is None and defaults.cpu_kv_cache_memory_mb == 256
    assert engine_config_from_args(parser.parse_args(["--cuda-graphs"])).cuda_graphs is True
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5).validate()


def test_cpu_decode_kernel_is_never_called_with_non_cpu_tensors(monkeypatch):
    """Meta tensors stand in for GPU ones: the C++ kernel has no meta (nor CUDA) implementation
    (and is not even loaded here), so reaching it would raise; the guard sends them down the
    gathered path."""
    from ctxgate.backend.model import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "load", lambda: True)  # as if built: the backend would use it
    spec = KVCacheSpec(1, 3, 64, 16, torch.bfloat16, False)
    cache = KVCache(spec, 4, torch.device("meta"))
    backend = CPUBatchedAttention(9, 3, 64)
    assert backend.use_kernel
    metadata = _decode_metadata(cache, torch.device("meta"), [[1, 2]], [20])
    out = backend.decode(0, torch.empty(1, 9, 64, dtype=torch.bfloat16, device="meta"), cache, metadata)
    assert out.device.type == "meta" and out.shape == (1, 9, 64)


def _decode_metadata(cache: KVCache, device: torch.device, tables: list[list[int]], lengths: list[int]):
    return AttentionMetadata(
        write_plan=cache.make_write_plan(torch.zeros(len(lengths), dtype=torch.long, device=device)),
        num_decodes=len(lengths),
        decode_blocks=torch.tensor(tables, device=device),
        decode_context_lens=torch.tensor(lengths, device=device),
        decode_bias=None,
        prefills=[],
    )


def test_runner_builds_every_index_tensor_on_the_engines_device():
    """The runner's step tensors follow its device (meta here: no GPU needed), none pinned to CPU."""
    meta = torch.device("meta")
    spec = KVCacheSpec(1, 3, 64, 16, torch.float32, False)
    runner = ModelRunner(None, KVCache(spec, 8, meta), CUDAAttention(9, 3, 64, "torch"), meta)  # type: ignore[arg-type]
    decoding = _sequence("decode", list(range(20)), computed=19, table=[3, 5])
    chunk = _sequence("chunk", list(range(40)), computed=16, table=[1, 2, 4])
    input_ids, positions, metadata, logits_rows, sampled = runner.prepare(
        [ScheduledSequence(chunk, 24), ScheduledSequence(decoding, 1)]
    )
    tensors = [
        input_ids,
        positions,
        logits_rows,
        metadata.write_plan.slot_mapping,
        metadata.decode_blocks,
        metadata.decode_context_lens,
        metadata.prefills[0].context_blocks,
        metadata.prefills[0].mask,
    ]
    assert all(tensor.device == meta for tensor in tensors)
    assert metadata.num_decodes == 1 and sampled == [decoding, chunk]


def _sequence(request_id: str, tokens: list[int], computed: int, table: list[int]) -> Sequence:
    seq = Sequence(request_id, tokens, GREEDY, max_tokens=4, arrival_order=0)
    seq.num_computed_tokens = computed
    seq.block_table = list(table)
    return seq


# ---------------------------------------------------------------- the Triton kernel, interpreted
def _paged_cache(
    dtype: torch.dtype, quantized: bool, lengths: list[int], block_size: int = 16, seed: int = 0
):
    """A one-layer pool holding random K/V for sequences of `lengths` in shuffled blocks."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-length // block_size) for length in lengths) + 3
    cache = KVCache(KVCacheSpec(1, 3, 64, block_size, dtype, quantized), num_blocks, CPU)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for length in lengths:
        table = [free.pop() for _ in range(-(-length // block_size))]
        tables.append(table)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        keys = torch.randn(length, 3, 64, generator=generator).to(dtype)
        values = torch.randn(length, 3, 64, generator=generator).to(dtype)
        cache.write(0, keys, values, cache.make_write_plan(slots))
    width = max(len(table) for table in tables) + 2  # padded tables, as the runner and graphs pass them
    # Padding columns point at a real block full of other data: the kernel must not read them.
    padded = torch.tensor([table + [free[0]] * (width - len(table)) for table in tables])
    query = torch.randn(len(lengths), 9, 64, generator=generator).to(dtype)
    return cache, padded, torch.tensor(lengths), query


TRITON_CASES = {  # name: (dtype, int8 KV, tolerance against the gathered float reference)
    "float32": (torch.float32, False, 1e-5),
    "bfloat16": (torch.bfloat16, False, 2e-2),
    "int8": (torch.bfloat16, True, 3e-2),
}


def triton_kernel_errors() -> dict[str, float]:
    """Max |Triton kernel - gathered reference| per case; run under TRITON_INTERPRET=1 (a fresh
    process: triton decides between compiling and interpreting when it is first imported)."""
    from ctxgate.backend.model import triton_paged_attention

    assert triton_paged_attention.interpreter_enabled()
    assert (
        CUDAAttention(9, 3, 64, decode_kernel="triton").decode_kernel_for(torch.empty(1, 9, 64), 16)
        == "triton"
    )
    errors = {}
    lengths = [1, 16, 17, 40, 100]  # one token, a full block, one past a block, several blocks
    for name, (dtype, quantized, _) in TRITON_CASES.items():
        cache, tables, context_lens, q = _paged_cache(dtype, quantized, lengths)
        out = triton_paged_attention.paged_decode_attention(
            q,
            cache.keys[0],
            cache.values[0],
            cache.key_scales[0] if quantized else None,
            cache.value_scales[0] if quantized else None,
            tables,
            context_lens,
            16,
            0.125,
        )
        assert out.dtype == dtype and out.shape == q.shape
        reference = gathered_decode_attention(
            q, cache, 0, tables, padding_bias(context_lens, tables.shape[1] * 16), 3, 0.125
        )
        errors[name] = (out.float() - reference.float()).abs().max().item()
    return errors


def test_triton_paged_decode_kernel_matches_the_gathered_reference(tmp_path):
    pytest.importorskip(
        "triton", reason="triton is not installed (pip install 'ctxgate[gpu]' or the dev extra)"
    )
    script = "import json; from tests.backend.test_attention_cuda import triton_kernel_errors as f; print(json.dumps(f()))"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    for name, (_, _, tolerance) in TRITON_CASES.items():
        assert errors[name] <= tolerance, f"{name}: max error {errors[name]}"


def test_triton_kernel_runs_on_gpu_tensors_only_unless_interpreted():
    pytest.importorskip("triton", reason="triton is not installed")
    from ctxgate.backend.model import triton_paged_attention

    if triton_paged_attention.interpreter_enabled():
        pytest.skip("this process imported triton in interpreter mode")
    backend = CUDAAttention(9, 3, 64)
    cpu_query = torch.empty(1, 9, 64)
    assert backend.decode_kernel_for(cpu_query, 16) == "torch"  # compiled Triton needs GPU tensors
    assert backend.decode_kernel_for(torch.empty(1, 9, 64, device="meta"), 16) == "torch"
    assert CUDAAttention(9, 3, 64, decode_kernel="torch").decode_kernel_for(cpu_query, 16) == "torch"
    assert not triton_paged_attention.shape_supported(64, 12) and not triton_paged_attention.shape_supported(
        80, 16
    )


def test_torch_decode_fallback_matches_the_reference_backend():
    cache, tables, context_lens, q = _paged_cache(torch.float32, False, [3, 33, 64])
    backend = CUDAAttention(9, 3, 64, decode_kernel="torch")
    metadata = AttentionMetadata(
        write_plan=None,
        num_decodes=3,
        decode_blocks=tables,
        decode_context_lens=context_lens,  # type: ignore[arg-type]
        decode_bias=None,
        prefills=[],
    )
    out = backend.decode(0, q, cache, metadata)
    reference = create_backend("reference", CPU, 9, 3, 64)
    for row, length in enumerate(context_lens.tolist()):
        blocks = tables[row, : -(-length // 16)]
        positions = torch.arange(length)
        keys, values = cache.gather(0, blocks[positions // 16] * 16 + positions % 16)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[row].unsqueeze(1),
            keys.repeat_interleave(3, 0),
            values.repeat_interleave(3, 0),
            scale=reference.scale,
        ).squeeze(1)
        torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the CUDA backend in the engine, on CPU
def _use_backend(engine, attention, graph_sizes: tuple[int, ...] | None = None) -> DecodeGraphs | None:
    """Rebuild the engine's runner around `attention` (and padded static-buffer decodes) on CPU: the
    same wiring LLMEngine does on CUDA, minus the graph capture."""
    spec = engine.kv_cache.spec
    num_blocks = engine.block_manager.num_blocks
    kv_cache = KVCache(spec, num_blocks + 1, engine.device)  # + the scratch block padding rows write
    graphs = None
    if graph_sizes:
        buffers = DecodeInputBuffers(
            max(graph_sizes),
            -(-engine.max_model_len // spec.block_size),
            num_blocks,
            spec.block_size,
            engine.device,
        )
        graphs = DecodeGraphs(engine.model, kv_cache, attention, buffers, graph_sizes, capture=False)
    engine.kv_cache = kv_cache
    engine.attention = attention
    engine.runner = ModelRunner(engine.model, kv_cache, attention, engine.device, graphs)
    return graphs


def test_cuda_backend_code_matches_hf_on_cpu(make_engine, parity_prompts, hf_greedy_reference):
    """Whole-context prefill, prefill chunks over a cached prefix (lower-right causal SDPA) and
    batched decodes through the torch fallback."""
    engine = make_engine(attention_backend="reference")
    _use_backend(engine, CUDAAttention(9, 3, 64, decode_kernel="torch"))
    assert engine.generate(parity_prompts, GREEDY) == hf_greedy_reference
    chunked = make_engine(attention_backend="reference", max_num_batched_tokens=16)
    _use_backend(chunked, CUDAAttention(9, 3, 64, decode_kernel="torch"))
    assert chunked.generate(parity_prompts, GREEDY) == hf_greedy_reference


def test_padded_static_decode_matches_hf(make_engine, parity_prompts, hf_greedy_reference, monkeypatch):
    """What the CUDA graphs replay, run eagerly: batches padded to 1/2/4/8 rows, padding rows in the
    scratch block. Prompts finish at different steps, so the padding changes as the batch shrinks."""
    engine = make_engine(attention_backend="reference", max_num_batched_tokens=64)
    graphs = _use_backend(engine, CUDAAttention(9, 3, 64, decode_kernel="torch"), graph_sizes=(1, 2, 4, 8))
    assert graphs is not None
    batches: list[tuple[int, int]] = []  # (rows, padded size) of every static decode step
    run = graphs.run
    monkeypatch.setattr(
        graphs,
        "run",
        lambda batch: batches.append((len(batch), padded_batch_size(len(batch), graphs.sizes))) or run(batch),
    )
    budgets = [PARITY_MAX_TOKENS - 2 * (i % 4) for i in range(len(parity_prompts))]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in budgets]
    outputs = engine.generate(parity_prompts, params)
    assert outputs == [expected[:n] for expected, n in zip(hf_greedy_reference, budgets, strict=True)]
    assert any(rows < size for rows, size in batches), "some steps must have run padded"
    assert len({size for _, size in batches}) >= 3
    assert engine.stats().num_kv_blocks_free == engine.stats().num_kv_blocks_total


def test_static_decode_runner_matches_the_regular_runner(make_engine, monkeypatch):
    """Same logits as the regular runner for the same step; a one-token prefill chunk with more
    prompt to come runs in the batch but is not sampled."""
    engine = make_engine(attention_backend="reference")
    graphs = _use_backend(engine, CUDAAttention(9, 3, 64, decode_kernel="torch"), graph_sizes=(1, 2, 4))
    assert graphs is not None
    calls = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda batch: calls.append(len(batch)) or run(batch))
    regular = ModelRunner(engine.model, engine.kv_cache, engine.attention, CPU)
    # Block 0 holds real K/V (the first positions of `decoding`): padding rows must not touch it.
    decoding = _sequence("decode", list(range(100, 130)), computed=29, table=[0, 1])
    chunk = _sequence("chunk", list(range(200, 240)), computed=20, table=[2, 3, 4])  # 20 prompt tokens to go
    short = _sequence("short", list(range(300, 306)), computed=5, table=[5])
    scheduled = [ScheduledSequence(decoding, 1), ScheduledSequence(chunk, 1), ScheduledSequence(short, 1)]
    kv = engine.kv_cache
    generator = torch.Generator().manual_seed(0)
    for keys, values in zip(kv.keys, kv.values, strict=True):  # a filled pool, not zeros
        keys.copy_(torch.randn(keys.shape, generator=generator))
        values.copy_(torch.randn(values.shape, generator=generator))
    real_slots = slice(0, engine.block_manager.num_blocks * 16)
    pool_before = [keys[:, real_slots].clone() for keys in kv.keys]
    expected = regular.execute(scheduled)
    pool_after_regular = [keys[:, real_slots].clone() for keys in kv.keys]
    got = engine.runner.execute(scheduled)  # 3 rows padded to 4
    assert calls == [3]
    assert got.sampled_sequences == expected.sampled_sequences == [decoding, short]
    # Padding changes the GEMMs' row count, and some CPUs' BLAS sums a row in another order for 4 rows
    # than for 3 (AMD EPYC: up to 5e-5 per float32 Linear, 3.4e-3 on these logits after 30 layers);
    # on the Intel machines the two agreed within 1e-5. The real rows' new K/V differ as little.
    torch.testing.assert_close(got.logits, expected.logits, atol=2e-2, rtol=1e-3)
    assert torch.equal(got.logits.argmax(-1), expected.logits.argmax(-1))
    for keys, before, after_regular in zip(kv.keys, pool_before, pool_after_regular, strict=True):
        now = keys[:, real_slots]
        written = after_regular != before  # where the three real rows put their new keys
        assert written.any()
        assert torch.equal(now[~written], after_regular[~written]), "a padding row wrote into a real block"
        torch.testing.assert_close(now[written], after_regular[written], atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------- padding and static buffers
def test_capture_and_padded_sizes():
    assert capture_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert capture_sizes(5) == (1, 2, 4, 8)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 32)  # larger batches run eagerly
    assert [padded_batch_size(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_buffers_pad_rows_into_the_scratch_block():
    buffers = DecodeInputBuffers(
        max_batch=8, max_blocks_per_seq=6, scratch_block=99, block_size=16, device=CPU
    )
    batch = DecodeBatch(
        input_ids=[11, 12, 13],
        positions=[20, 0, 40],
        slot_mapping=[52, 16, 104],
        block_tables=[[7, 3], [1], [2, 4, 6]],
        context_lens=[21, 1, 41],
    )
    buffers.fill(batch, 4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [20, 0, 40, 0]
    assert buffers.slot_mapping[:4].tolist() == [52, 16, 104, 99 * 16]
    assert buffers.context_lens[:4].tolist() == [21, 1, 41, 1]
    assert buffers.block_tables[:4, :3].tolist() == [[7, 3, 99], [1, 99, 99], [2, 4, 6], [99, 99, 99]]
    metadata = buffers.metadata(4, KVCache(KVCacheSpec(1, 3, 64, 16, torch.float32, False), 100, CPU))
    assert metadata.num_decodes == 4 and metadata.decode_blocks.shape == (4, 6)
    assert metadata.decode_blocks.data_ptr() == buffers.block_tables.data_ptr()  # static addresses
    # A smaller batch next: its rows overwrite, the rest become padding again.
    buffers.fill(DecodeBatch([5], [3], [35], [[2]], [4]), 2)
    assert buffers.slot_mapping[:2].tolist() == [35, 99 * 16] and buffers.context_lens[:2].tolist() == [4, 1]
    with pytest.raises(ValueError, match="cannot pad"):
        buffers.fill(batch, 2)
    with pytest.raises(ValueError, match="exceeds"):
        buffers.fill(DecodeBatch([1], [0], [0], [[1] * 7], [100]), 1)


def test_decode_graphs_refuse_what_they_cannot_replay():
    spec = KVCacheSpec(1, 3, 64, 16, torch.bfloat16, True)
    buffers = DecodeInputBuffers(4, 4, 9, 16, CPU)
    with pytest.raises(ValueError, match="int8"):
        DecodeGraphs(None, KVCache(spec, 10, CPU), CUDAAttention(9, 3, 64, "torch"), buffers, (1, 2), False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="static-shape"):
        DecodeGraphs(
            None, KVCache(spec, 10, CPU), create_backend("reference", CPU, 9, 3, 64), buffers, (1,), False
        )  # type: ignore[arg-type]


# ---------------------------------------------------------------- KV pool from GPU memory
def test_kv_pool_takes_what_utilization_leaves():
    gib = 2**30
    # 80 GiB GPU, 2 GiB in use (weights, context), 0.9: 72 - 2 - 1 reserve = 69 GiB of 1 MiB blocks.
    assert kv_blocks_for_gpu_memory(78 * gib, 80 * gib, 0.9, 2**20, reserve_bytes=gib) == 69 * 1024
    # Other processes' memory counts against the budget too.
    assert kv_blocks_for_gpu_memory(40 * gib, 80 * gib, 0.9, 2**20) == 32 * 1024
    assert kv_blocks_for_gpu_memory(78 * gib, 80 * gib, 0.5, 3 * 2**20) == (38 * gib) // (3 * 2**20)
    with pytest.raises(ValueError, match="no room for the KV cache"):
        kv_blocks_for_gpu_memory(20 * gib, 80 * gib, 0.5, 2**20)


def test_activation_reserve_grows_with_the_step():
    small = activation_reserve_bytes(576, 1536, 960, 49152, 512, 32, 2)
    large = activation_reserve_bytes(576, 1536, 960, 49152, 2048, 32, 2)
    assert small == 512 * (4 * 576 + 2 * 960 + 3 * 1536) * 2 + 3 * 32 * 49152 * 4 + 512 * 2**20
    assert large > small
