"""CPU decode steps traced into TorchScript (`backend/model/decode_graphs.py`, `cpu_decode_graphs`): a
traced step computes what the eager step computes, its padding rows never touch a real block, the
engine generates through it, and a trace that cannot run is a clear start-up error; on this CPU's
own kernel build and, in a child process, capped to AVX2 (the other build that traces)."""

from __future__ import annotations

import pytest
import torch

from ctxgate.backend.engine.api import GenerationRequest, SamplingParams
from ctxgate.backend.engine.scheduler import ScheduledSequence
from ctxgate.backend.engine.sequence import Sequence
from ctxgate.backend.model import cpu_kernels
from ctxgate.backend.platform.cpu_features import ISA_CAP_ENV, cpu_path, runnable_kernel_isas
from tests.backend.capped_cpu import run_capped

# Traced steps run every matmul through the C++ GEMV over bfloat16 weights.
TRACEABLE = cpu_path().auto_dtype == "bfloat16" and cpu_kernels.load()
pytestmark = pytest.mark.skipif(
    not TRACEABLE, reason="needs the C++ CPU kernels and bfloat16 (AVX2 or AVX-512 BF16)"
)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def traced_engine(model_dir):
    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.backend.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="bfloat16",
            kv_cache_memory_mb=32,
            num_threads=1,
            max_num_seqs=8,
            cpu_decode_graphs=True,
        )
    )


def _sequence(request_id: str, tokens: list[int], computed: int, table: list[int]) -> Sequence:
    seq = Sequence(request_id, tokens, GREEDY, max_tokens=4, arrival_order=0)
    seq.num_computed_tokens = computed
    seq.block_table = list(table)
    return seq


def test_the_engine_traces_each_padded_size(traced_engine):
    graphs = traced_engine.runner.decode_graphs
    assert graphs is not None and graphs.trace and not graphs.graphs
    assert sorted(graphs.traced) == [1, 2, 4, 8] == traced_engine.path_info()["traced_decode_batch_sizes"]
    assert "traced decode up to 8 rows" in traced_engine.cpu_path_summary()


def test_a_traced_step_computes_the_eager_step_and_padding_stays_in_the_scratch_block(traced_engine):
    engine = traced_engine
    graphs = engine.runner.decode_graphs
    kv = engine.kv_cache
    generator = torch.Generator().manual_seed(0)
    for keys, values in zip(kv.keys, kv.values, strict=True):  # a filled pool, not zeros
        keys.copy_(torch.randn(keys.shape, generator=generator))
        values.copy_(torch.randn(values.shape, generator=generator))
    scheduled = [
        ScheduledSequence(_sequence("a", list(range(100, 130)), computed=29, table=[0, 1]), 1),
        ScheduledSequence(_sequence("b", list(range(200, 206)), computed=5, table=[2]), 1),
        ScheduledSequence(_sequence("c", list(range(300, 341)), computed=40, table=[3, 4, 5]), 1),
    ]
    real_slots = slice(0, engine.block_manager.num_blocks * engine.config.block_size)
    before = [keys[:, real_slots].clone() for keys in kv.keys]

    calls = []
    traced_run = graphs.traced[4]
    graphs.traced[4] = lambda *inputs: calls.append(len(inputs[0])) or traced_run(*inputs)
    try:
        traced = engine.runner.execute(scheduled)  # 3 rows, padded to 4
    finally:
        graphs.traced[4] = traced_run
    assert calls == [4]
    after_traced = [keys[:, real_slots].clone() for keys in kv.keys]
    for keys, snapshot in zip(kv.keys, before, strict=True):
        keys[:, real_slots] = snapshot  # the eager step writes the same K/V again
    # The eager forward over the buffers the traced step read (still holding its padded batch),
    # with the kernels the trace recorded.
    with graphs._traceable(4):
        eager = graphs._forward(4)[:3]
    assert torch.equal(traced.logits, eager)
    assert [seq.request_id for seq in traced.sampled_sequences] == ["a", "b", "c"]
    for snapshot, written in zip(before, after_traced, strict=True):
        changed = (written != snapshot).any(dim=-1).any(dim=0)  # the slots whose keys changed
        assert changed.nonzero().flatten().tolist() == [1 * 16 + 13, 2 * 16 + 5, 5 * 16 + 8]


def test_the_engine_generates_through_traced_steps(traced_engine, model_dir):
    """One request alone runs the same kernels either way: the same tokens as an eager engine.
    Three at once run padded to four and free every block when done."""
    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.backend.engine.llm_engine import LLMEngine

    engine = traced_engine
    prompts = [
        engine.tokenizer.encode(text) for text in ("The capital of France is", "1, 2, 3,", "Hello, my")
    ]
    eager = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="bfloat16",
            kv_cache_memory_mb=32,
            num_threads=1,
            max_num_seqs=8,
            cpu_decode_graphs=False,
        )
    )
    assert eager.runner.decode_graphs is None
    assert _generate(engine, prompts[:1]) == _generate(eager, prompts[:1])

    sizes = []
    run = engine.runner.decode_graphs.run
    engine.runner.decode_graphs.run = lambda batch: sizes.append(len(batch)) or run(batch)
    try:
        outputs = _generate(engine, prompts)
    finally:
        engine.runner.decode_graphs.run = run
    assert all(len(tokens) == GREEDY.max_tokens for tokens in outputs)
    assert 3 in sizes
    assert engine.stats().num_kv_blocks_free == engine.stats().num_kv_blocks_total


def _generate(engine, prompts: list[list[int]]) -> list[list[int]]:
    for index, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"gen-{index}-{len(prompt)}", prompt, GREEDY))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
    return [tokens[f"gen-{index}-{len(prompt)}"] for index, prompt in enumerate(prompts)]


def test_a_required_trace_that_cannot_run_is_a_clear_error(make_engine):
    with pytest.raises(ValueError, match="--cpu-decode-graphs cannot run: .*bfloat16"):
        make_engine(dtype="float32", cpu_decode_graphs=True)
    assert make_engine(dtype="float32").runner.decode_graphs is None, (
        "by default an untraceable engine runs eagerly"
    )


def test_a_trace_that_fails_leaves_the_engine_eager_unless_it_was_required(make_engine, monkeypatch):
    from ctxgate.backend.model.decode_graphs import DecodeGraphs

    def refuse(self):
        raise RuntimeError("this tracer rejects an op")

    monkeypatch.setattr(DecodeGraphs, "trace_all", refuse)
    assert make_engine(dtype="bfloat16").runner.decode_graphs is None
    with pytest.raises(RuntimeError, match="rejects an op"):
        make_engine(dtype="bfloat16", cpu_decode_graphs=True)


def test_traced_decode_on_the_avx2_build(tmp_path):
    """AVX2 is the other kernel build that traces (portable runs float32, eagerly): where this CPU's
    own build is AVX-512, the tests above run again capped to AVX2."""
    import os

    runnable = runnable_kernel_isas()
    if os.environ.get(ISA_CAP_ENV) or runnable[0] == "avx2":
        pytest.skip("this process already runs the AVX2 build (the tests above cover it)")
    result = run_capped("avx2", __file__, tmp_path, "not avx2_build")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "5 passed" in result.stdout, result.stdout[-1000:]
