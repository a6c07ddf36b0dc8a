"""Everything the engine decides once, at start-up: device, dtype, optional decode paths, KV pool size.

Each function refuses, before anything is loaded where it can, an option the device has no path for;
an optional path left to "where possible" (None) is silently off where it cannot run.
"""

from __future__ import annotations

import logging
import time

import torch

from ctxgate.backend.engine.config import EngineConfig
from ctxgate.backend.model.attention import AttentionBackend, resolve_backend_name
from ctxgate.backend.model.decode_graphs import (
    TRACED_DECODE_MAX_BATCH,
    DecodeGraphs,
    DecodeInputBuffers,
    capture_sizes,
    untraceable_reason,
)
from ctxgate.backend.model.kv_cache import (
    KVCache,
    KVCacheSpec,
    activation_reserve_bytes,
    kv_blocks_for_gpu_memory,
)
from ctxgate.backend.model.llama import LlamaModel
from ctxgate.backend.platform.cpu_features import cpu_path

logger = logging.getLogger(__name__)


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
        raise ValueError(
            "--weight-quant int4 runs on CPU only (torch's int4pack CPU kernel); drop it on CUDA"
        )
    if device.type != "cuda" and config.cuda_graphs:
        raise ValueError(f"--cuda-graphs needs a CUDA device; this engine runs on {device}")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bfloat16 halves the weight bytes a decode step streams; on CPU the choice depends on
        # the kernels this CPU runs (ctxgate.backend.platform.cpu_features: AVX-512 BF16 or AVX2 -> bfloat16).
        if device.type == "cuda":
            return torch.bfloat16
        return getattr(torch, cpu_path().auto_dtype)
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


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


def use_traced_decode(
    config: EngineConfig,
    device: torch.device,
    attention: AttentionBackend,
    model: LlamaModel,
    kv_spec: KVCacheSpec,
) -> bool:
    """Whether CPU decode steps run as traced functions (config.cpu_decode_graphs None = where they can)."""
    reasons = []
    if device.type != "cpu":
        reasons.append(f"the device is {device}")
    if not attention.supports_traced_decode:
        reasons.append(f"attention backend {attention.name!r} has no static-shape CPU decode")
    if device.type == "cpu" and (reason := untraceable_reason(model, kv_spec)):
        reasons.append(reason)
    return _where_possible(config.cpu_decode_graphs, "--cpu-decode-graphs", reasons)


def kv_pool_blocks(
    config: EngineConfig, device: torch.device, model: LlamaModel, spec: KVCacheSpec, dtype: torch.dtype
) -> int:
    """How many KV blocks the pool gets: as configured, from the CPU memory setting, or from free GPU
    memory after what a full step's activations need."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if device.type != "cuda" or config.kv_cache_memory_mb is not None:
        return spec.blocks_for_memory(config.cpu_kv_cache_memory_mb)
    arch = model.config
    reserve = activation_reserve_bytes(
        arch.hidden_size,
        arch.intermediate_size,
        (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim,
        arch.vocab_size,
        config.max_num_batched_tokens,
        config.max_num_seqs,
        torch.empty((), dtype=dtype).element_size(),
    )
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    num_blocks = kv_blocks_for_gpu_memory(
        free, total, config.gpu_memory_utilization, spec.bytes_per_block, reserve
    )
    logger.info(
        "KV pool from GPU memory: %.1f of %.1f GiB free, utilization %.2f, %.1f GiB kept for activations: "
        "%d blocks (%.1f GiB)",
        free / 2**30,
        total / 2**30,
        config.gpu_memory_utilization,
        reserve / 2**30,
        num_blocks,
        num_blocks * spec.bytes_per_block / 2**30,
    )
    return num_blocks


def build_decode_graphs(
    config: EngineConfig,
    model: LlamaModel,
    kv_cache: KVCache,
    attention: AttentionBackend,
    device: torch.device,
    max_model_len: int,
    scratch_block: int,
    traced: bool,
) -> DecodeGraphs | None:
    """CUDA graphs (traced=False) or traced CPU decode steps for the batch sizes the engine runs.

    Where traced steps were not asked for explicitly, a trace that fails (a torch build whose tracer
    rejects an op) leaves the engine eager instead of down."""
    sizes = capture_sizes(config.max_num_seqs)
    if traced:
        sizes = tuple(size for size in sizes if size <= TRACED_DECODE_MAX_BATCH)
    max_blocks_per_seq = -(-max_model_len // config.block_size)
    buffers = DecodeInputBuffers(max(sizes), max_blocks_per_seq, scratch_block, config.block_size, device)
    try:
        graphs = DecodeGraphs(model, kv_cache, attention, buffers, sizes, capture=not traced, trace=traced)
        started = time.perf_counter()
        graphs.capture_all()
    except Exception:
        if not traced or config.cpu_decode_graphs:
            raise
        logger.warning("tracing the CPU decode steps failed; decode steps run eagerly", exc_info=True)
        return None
    logger.info(
        "decode %s in %.1f s",
        "steps traced" if traced else "CUDA graphs captured",
        time.perf_counter() - started,
    )
    return graphs
