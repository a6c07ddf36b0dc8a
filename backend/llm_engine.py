"""The synchronous engine: requests in, one scheduler iteration per `step()`, deltas out.

Used from a single thread (the async wrapper's engine thread), so it holds no locks.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch

from backend.api import EngineError, GenerationDelta, GenerationRequest, RequestMetrics, SamplingParams
from backend.attention import AttentionBackend, create_backend, resolve_backend_name
from backend.block_manager import BlockManager
from backend.config import EngineConfig
from backend.cpu_features import cpu_path
from backend.decode_graphs import (
    TRACED_DECODE_MAX_BATCH,
    DecodeGraphs,
    DecodeInputBuffers,
    capture_sizes,
    untraceable_reason,
)
from backend.kv_cache import KVCache, KVCacheSpec, activation_reserve_bytes, kv_blocks_for_gpu_memory
from backend.model import LlamaModel
from backend.model_loader import load_model
from backend.model_runner import ModelRunner
from backend.sampler import sample
from backend.scheduler import Scheduler
from backend.sequence import Sequence, SequenceStatus
from backend.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    kv_cache_usage: float
    prefix_cache_queried_tokens: int  # cumulative
    prefix_cache_hit_tokens: int  # cumulative
    num_preemptions: int  # cumulative
    kv_bytes_per_token: int
    ttft_target_misses: int  # cumulative
    last_step_batch_size: int
    last_step_num_tokens: int


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when torch sees a GPU; a CUDA device torch cannot use is a start-up error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {name}: torch {torch.__version__} sees no CUDA device "
                f"(built for CUDA {torch.version.cuda or 'no CUDA: a CPU-only build'}); use --device cpu or auto"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: torch sees {count} CUDA device(s)")
    return device


def check_device_support(config: EngineConfig, device: torch.device) -> None:
    """Refuse, before loading anything, the options the device has no path for."""
    resolve_backend_name(config.attention_backend, device)
    if device.type == "cuda" and config.weight_quant == "int4":
        raise ValueError("--weight-quant int4 runs on CPU only (torch's int4pack CPU kernel); drop it on CUDA")
    if device.type != "cuda" and config.cuda_graphs:
        raise ValueError(f"--cuda-graphs needs a CUDA device; this engine runs on {device}")


def _where_possible(asked: bool | None, option: str, reasons: list[str]) -> bool:
    """An optional engine path: off when asked off, else on unless `reasons` stand in its way,
    which is a start-up error when it was asked for explicitly."""
    if reasons and asked:
        raise ValueError(f"{option} cannot run: {'; '.join(reasons)}")
    return asked is not False and not reasons


def use_decode_graphs(config: EngineConfig, device: torch.device, attention: AttentionBackend) -> bool:
    """Whether decode steps run through captured CUDA graphs (config.cuda_graphs None = where they can)."""
    reasons = []
    if device.type != "cuda":
        reasons.append(f"the device is {device}")
    if not attention.supports_decode_graphs:
        reasons.append(f"attention backend {attention.name!r} has no static-shape decode")
    if config.kv_cache_dtype == "int8":
        reasons.append("int8 KV writes have data-dependent shapes")
    return _where_possible(config.cuda_graphs, "--cuda-graphs", reasons)


def use_traced_decode(config: EngineConfig, device: torch.device, attention: AttentionBackend,
                      model: LlamaModel, kv_spec: KVCacheSpec) -> bool:
    """Whether CPU decode steps run as traced functions (config.cpu_decode_graphs None = where they can)."""
    reasons = []
    if device.type != "cpu":
        reasons.append(f"the device is {device}")
    if not attention.supports_traced_decode:
        reasons.append(f"attention backend {attention.name!r} has no static-shape CPU decode")
    if device.type == "cpu" and (reason := untraceable_reason(model, kv_spec)):
        reasons.append(reason)
    return _where_possible(config.cpu_decode_graphs, "--cpu-decode-graphs", reasons)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bfloat16 halves the weight bytes a decode step streams; on CPU the choice depends on
        # the kernels this CPU runs (backend.cpu_features: AVX-512 BF16 or AVX2 -> bfloat16).
        if device.type == "cuda":
            return torch.bfloat16
        return getattr(torch, cpu_path().auto_dtype)
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from backend.model_prepare import resolve_model_path

        config.validate()
        self.config = config
        self.num_threads = config.num_threads or os.cpu_count() or 1
        torch.set_num_threads(self.num_threads)
        model_path = resolve_model_path(config.model)
        self.model_name = model_path.name
        self.device = resolve_device(config.device)
        check_device_support(config, self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.tokenizer: Tokenizer = load_tokenizer(str(model_path))
        self.model = load_model(model_path, self.dtype, self.device, config.weight_quant)
        arch = self.model.config
        self.attention = create_backend(
            config.attention_backend, self.device, arch.num_heads, arch.num_kv_heads, arch.head_dim
        )
        graphs = use_decode_graphs(config, self.device, self.attention)

        spec = KVCacheSpec(
            num_layers=arch.num_layers,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            block_size=config.block_size,
            dtype=self.dtype,
            quantized=config.kv_cache_dtype == "int8",
        )
        num_blocks = self._kv_pool_blocks(spec)
        # A sequence longer than the whole pool could never be scheduled: cap the context there.
        self.max_model_len = min(
            config.max_model_len or min(arch.max_position_embeddings, DEFAULT_MAX_MODEL_LEN),
            num_blocks * config.block_size,
        )
        self.model.init_rotary(self.max_model_len)
        traced = not graphs and use_traced_decode(config, self.device, self.attention, self.model, spec)
        # Decode graphs pad batches with rows writing to a scratch block beyond the manager's pool.
        self.kv_cache = KVCache(spec, num_blocks + (1 if graphs or traced else 0), self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_batched_tokens, config.max_num_seqs, config.ttft_target_ms
        )
        decode_graphs = None
        if graphs:
            decode_graphs = self._capture_decode_graphs(num_blocks)
        elif traced:
            decode_graphs = self._trace_decode_steps(num_blocks)
        self.runner = ModelRunner(self.model, self.kv_cache, self.attention, self.device, decode_graphs)
        self.vocab_size = arch.vocab_size
        self.sequences: dict[str, Sequence] = {}
        self._arrival_counter = itertools.count()
        self.ttft_target_misses = 0
        self.last_step_batch_size = 0
        self.last_step_num_tokens = 0
        logger.info(
            "engine ready: %s %s on %s, %d KV blocks of %d tokens (%s), attention=%s; %s",
            self.model_name, self.dtype, self.device, num_blocks, config.block_size,
            "int8" if spec.quantized else str(self.dtype), self.attention.name, self.cpu_path_summary(),
        )

    def _kv_pool_blocks(self, spec: KVCacheSpec) -> int:
        config = self.config
        if config.num_kv_blocks:
            return config.num_kv_blocks
        if self.device.type != "cuda" or config.kv_cache_memory_mb is not None:
            return spec.blocks_for_memory(config.cpu_kv_cache_memory_mb)
        arch = self.model.config
        reserve = activation_reserve_bytes(
            arch.hidden_size, arch.intermediate_size, (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim,
            arch.vocab_size, config.max_num_batched_tokens, config.max_num_seqs,
            torch.empty((), dtype=self.dtype).element_size(),
        )
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        num_blocks = kv_blocks_for_gpu_memory(free, total, config.gpu_memory_utilization, spec.bytes_per_block, reserve)
        logger.info(
            "KV pool from GPU memory: %.1f of %.1f GiB free, utilization %.2f, %.1f GiB kept for activations: "
            "%d blocks (%.1f GiB)", free / 2**30, total / 2**30, config.gpu_memory_utilization, reserve / 2**30,
            num_blocks, num_blocks * spec.bytes_per_block / 2**30,
        )
        return num_blocks

    def _capture_decode_graphs(self, scratch_block: int, traced: bool = False) -> DecodeGraphs:
        config = self.config
        sizes = capture_sizes(config.max_num_seqs)
        if traced:
            sizes = tuple(size for size in sizes if size <= TRACED_DECODE_MAX_BATCH)
        max_blocks_per_seq = -(-self.max_model_len // config.block_size)
        buffers = DecodeInputBuffers(max(sizes), max_blocks_per_seq, scratch_block, config.block_size, self.device)
        graphs = DecodeGraphs(self.model, self.kv_cache, self.attention, buffers, sizes, capture=not traced,
                              trace=traced)
        started = time.perf_counter()
        graphs.capture_all()
        logger.info("decode %s in %.1f s", "steps traced" if traced else "CUDA graphs captured",
                    time.perf_counter() - started)
        return graphs

    def _trace_decode_steps(self, scratch_block: int) -> DecodeGraphs | None:
        """Traced CPU decode steps; where they were not asked for explicitly, a trace that fails
        (a torch build whose tracer rejects an op) leaves the engine eager instead of down."""
        try:
            return self._capture_decode_graphs(scratch_block, traced=True)
        except Exception:
            if self.config.cpu_decode_graphs:
                raise
            logger.warning("tracing the CPU decode steps failed; decode steps run eagerly", exc_info=True)
            return None

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> None:
        if request.request_id in self.sequences:
            raise EngineError(f"duplicate request id {request.request_id!r}", 400)
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise EngineError("the prompt is empty", 400)
        if len(prompt) > self.max_model_len:
            raise EngineError(
                f"the prompt has {len(prompt)} tokens but the context window is {self.max_model_len} tokens",
                400,
            )
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise EngineError(f"prompt token ids must be in [0, {self.vocab_size})", 400)
        try:
            request.sampling.validate()
        except ValueError as exc:
            raise EngineError(str(exc), 400) from exc
        sampling = request.sampling
        seq = Sequence(
            request_id=request.request_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            max_tokens=max(1, min(sampling.max_tokens, self.max_model_len - len(prompt))),
            arrival_order=next(self._arrival_counter),
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        if request.arrival_time is not None:
            seq.arrival_time = request.arrival_time
        if sampling.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self.sequences[request.request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.scheduler.remove(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[GenerationDelta]:
        output = self.scheduler.schedule()
        self.last_step_batch_size = len(output.scheduled)
        self.last_step_num_tokens = output.num_tokens
        if output.is_empty:
            return []
        started = time.perf_counter()
        result = self.runner.execute(output.scheduled)
        tokens = sample(result.logits, result.sampled_sequences, self.tokenizer.eos_token_ids)
        finished_at = time.perf_counter()
        num_prefill_tokens = 0
        for item in output.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(item.seq)
            if item.num_new_tokens > 1:
                num_prefill_tokens += item.num_new_tokens
        self.scheduler.observe_step(num_prefill_tokens, finished_at - started)
        return [self._append_token(seq, token, finished_at) for seq, token in zip(result.sampled_sequences, tokens, strict=True)]

    def _append_token(self, seq: Sequence, token: int, now: float) -> GenerationDelta:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
            if (now - seq.arrival_time) * 1000.0 > self.config.ttft_target_ms:
                self.ttft_target_misses += 1
        params = seq.sampling
        finish_reason = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.tokenizer.eos_token_ids):
            finish_reason = "stop"
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            finish_reason = "length"

        assert seq.detokenizer is not None
        seq.detokenizer.add([token])
        text = seq.detokenizer.text
        if finish_reason is not None:
            text += seq.detokenizer.flush()
        stop_at = self._find_stop_string(seq, text)
        if stop_at is not None:
            text = text[:stop_at]
            finish_reason = "stop"
        if finish_reason is None and params.stop:
            # Hold back a possible partial stop string until it is confirmed or ruled out.
            emit_until = max(seq.emitted_text_len, len(text) - (max(map(len, params.stop)) - 1))
        else:
            emit_until = len(text)
        delta = GenerationDelta(
            request_id=seq.request_id,
            text=text[seq.emitted_text_len : emit_until],
            token_ids=[token],
        )
        seq.emitted_text_len = emit_until
        if finish_reason is not None:
            self._finish(seq, finish_reason, now, delta)
        return delta

    @staticmethod
    def _find_stop_string(seq: Sequence, text: str) -> int | None:
        if not seq.sampling.stop:
            return None
        # Only the text not yet emitted (plus the held-back tail) can contain a new match.
        search_from = max(0, seq.emitted_text_len - max(map(len, seq.sampling.stop)))
        positions = [p for p in (text.find(stop, search_from) for stop in seq.sampling.stop) if p >= 0]
        return min(positions) if positions else None

    def _finish(self, seq: Sequence, reason: str, now: float, delta: GenerationDelta) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now
        self.scheduler.remove(seq)
        self.sequences.pop(seq.request_id, None)
        first_token = seq.first_token_time or now
        first_scheduled = seq.first_scheduled_time or seq.arrival_time
        num_output = seq.num_output_tokens
        delta.finish_reason = reason
        delta.prompt_tokens = seq.num_prompt_tokens
        delta.completion_tokens = num_output
        delta.metrics = RequestMetrics(
            queue_ms=(first_scheduled - seq.arrival_time) * 1000.0,
            prefill_ms=(first_token - first_scheduled) * 1000.0,
            ttft_ms=(first_token - seq.arrival_time) * 1000.0,
            tpot_ms=(now - first_token) * 1000.0 / (num_output - 1) if num_output > 1 else 0.0,
            e2e_ms=(now - seq.arrival_time) * 1000.0,
            cached_prompt_tokens=seq.cached_prompt_tokens or 0,
            preemptions=seq.num_preemptions,
        )

    # ---- introspection -----------------------------------------------------------------------
    def path_info(self) -> dict[str, object]:
        """Which compute path this engine runs: shown on /v1/models, in metrics and bench reports."""
        info: dict[str, object] = {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_dtype": "int8" if self.kv_cache.spec.quantized else str(self.dtype).removeprefix("torch."),
            "weight_quant": self.config.weight_quant,
            "attention": self.attention.name,
            "threads": self.num_threads,
        }
        if self.device.type == "cuda":
            graphs = self.runner.decode_graphs
            decode_kernel = getattr(self.attention, "decode_kernel_for", None)
            probe = torch.empty(0, device=self.device)
            info.update({
                "gpu": torch.cuda.get_device_name(self.device),
                "decode_kernel": decode_kernel(probe, self.kv_cache.spec.block_size) if decode_kernel else "none",
                "cuda_graph_batch_sizes": list(graphs.sizes) if graphs else [],
            })
        if self.device.type == "cpu":
            path = cpu_path()
            plan = self.model.matmul_plan
            info.update({
                "cpu_model": path.model_name,
                "cpu_flags": list(path.flags),
                "cpu_kernel_isa": path.kernel_isa if self.model.use_fused_layers else "none",
                "cpu_isa_capped_by": path.capped_by,
                "matmul": plan.summary() if plan else "plain",
                "traced_decode_batch_sizes": list(graphs.sizes) if (graphs := self.runner.decode_graphs) else [],
            })
        return info

    def cpu_path_summary(self) -> str:
        info = self.path_info()
        if self.device.type != "cpu":
            return f"device {info['device']}"
        traced = info["traced_decode_batch_sizes"]
        decode = f"traced decode up to {max(traced)} rows" if traced else "eager decode"  # type: ignore[type-var]
        return f"cpu kernels {info['cpu_kernel_isa']}, {info['matmul']}, {decode}, flags {' '.join(info['cpu_flags'])}"

    def stats(self) -> EngineStats:
        total = self.block_manager.num_blocks
        free = self.block_manager.num_free_blocks
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_total=total,
            num_kv_blocks_free=free,
            kv_cache_usage=(total - free) / total if total else 0.0,
            prefix_cache_queried_tokens=self.scheduler.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=self.scheduler.prefix_cache_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            kv_bytes_per_token=self.kv_cache.spec.kv_bytes_per_token,
            ttft_target_misses=self.ttft_target_misses,
            last_step_batch_size=self.last_step_batch_size,
            last_step_num_tokens=self.last_step_num_tokens,
        )

    # ---- sync helper ---------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Add all prompts, step until they finish, return each prompt's generated token ids."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        request_ids = [f"generate-{next(self._arrival_counter)}-{i}" for i in range(len(prompts))]
        outputs: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
        for request_id, prompt, sampling_params in zip(request_ids, prompts, params, strict=True):
            self.add_request(GenerationRequest(request_id, list(prompt), sampling_params))
        pending = set(request_ids)
        while pending:
            for delta in self.step():
                if delta.request_id in outputs:
                    outputs[delta.request_id].extend(delta.token_ids)
                    if delta.finish_reason is not None:
                        pending.discard(delta.request_id)
            if pending and not self.has_unfinished_requests():
                raise RuntimeError("engine stopped with unfinished generate() requests")
        return [outputs[request_id] for request_id in request_ids]
