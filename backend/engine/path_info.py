"""Which compute path an engine runs (device, dtype, kernels, decode graphs): shown on /v1/models, in
metrics, in the start-up log and in bench reports."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ctxgate.backend.platform.cpu_features import cpu_path

if TYPE_CHECKING:
    from ctxgate.backend.engine.llm_engine import LLMEngine


def compute_path_info(engine: LLMEngine) -> dict[str, object]:
    dtype = str(engine.dtype).removeprefix("torch.")
    info: dict[str, object] = {
        "device": str(engine.device),
        "dtype": dtype,
        "kv_cache_dtype": "int8" if engine.kv_cache.spec.quantized else dtype,
        "weight_quant": engine.config.weight_quant,
        "attention": engine.attention.name,
        "threads": engine.num_threads,
    }
    graphs = engine.runner.decode_graphs
    if engine.device.type == "cuda":
        decode_kernel = getattr(engine.attention, "decode_kernel_for", None)
        probe = torch.empty(0, device=engine.device)
        info.update(
            {
                "gpu": torch.cuda.get_device_name(engine.device),
                "decode_kernel": decode_kernel(probe, engine.kv_cache.spec.block_size)
                if decode_kernel
                else "none",
                "cuda_graph_batch_sizes": list(graphs.sizes) if graphs else [],
            }
        )
    if engine.device.type == "cpu":
        path = cpu_path()
        plan = engine.model.matmul_plan
        info.update(
            {
                "cpu_model": path.model_name,
                "cpu_flags": list(path.flags),
                "cpu_kernel_isa": path.kernel_isa if engine.model.use_fused_layers else "none",
                "cpu_isa_capped_by": path.capped_by,
                "matmul": plan.summary() if plan else "plain",
                "traced_decode_batch_sizes": list(graphs.sizes) if graphs else [],
            }
        )
    return info


def compute_path_summary(engine: LLMEngine) -> str:
    """One line for the start-up log."""
    info = compute_path_info(engine)
    if engine.device.type != "cpu":
        return f"device {info['device']}"
    traced = info["traced_decode_batch_sizes"]
    decode = f"traced decode up to {max(traced)} rows" if traced else "eager decode"  # type: ignore[type-var]
    return f"cpu kernels {info['cpu_kernel_isa']}, {info['matmul']}, {decode}, flags {' '.join(info['cpu_flags'])}"
