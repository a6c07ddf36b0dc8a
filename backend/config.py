"""Engine configuration: one dataclass shared by the engine, its CLI flags and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CPU_KV_CACHE_MB = 256


@dataclass
class EngineConfig:
    model: str | None = None  # HF dir; None -> default model via backend.model_prepare.resolve_model_path
    dtype: str = "auto"  # auto|float32|bfloat16|float16 ; auto = fastest accurate dtype on the device
    device: str = "auto"  # auto|cpu|cuda
    block_size: int = 16
    num_kv_blocks: int | None = None  # if None, derived from kv_cache_memory_mb
    # KV pool size; None: 256 MiB on CPU, on CUDA what gpu_memory_utilization leaves after the weights.
    kv_cache_memory_mb: int | None = None
    # CUDA: the fraction of the GPU's total memory the engine may hold (weights, activations, KV
    # pool), like vLLM's; what other processes already use counts against it too.
    gpu_memory_utilization: float = 0.9
    # Decode CUDA graphs: None = on where they run (CUDA, the cuda attention backend, 16/32-bit
    # KV); True = required (a start-up error where they cannot run); False = off.
    cuda_graphs: bool | None = None
    # CPU decode steps traced into TorchScript, one function per padded batch size: None = on where
    # they run (the C++ kernels, bfloat16 weights and KV); True = required; False = off.
    cpu_decode_graphs: bool | None = None
    kv_cache_dtype: str = "auto"  # auto (= model dtype) | int8
    # none | int4: decode-sized matmuls read 4-bit weights (groups of 32, asymmetric); the default
    # model ships as Q4_1, whose grid int4 reproduces up to bfloat16 scale rounding.
    weight_quant: str = "none"
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    max_model_len: int | None = None  # default: min(model max positions, 8192)
    enable_prefix_caching: bool = True
    ttft_target_ms: float = 1500.0
    num_threads: int | None = None  # torch.set_num_threads; default os.cpu_count()
    attention_backend: str = "auto"  # auto|reference|cpu_batched|cuda

    @property
    def cpu_kv_cache_memory_mb(self) -> int:
        return DEFAULT_CPU_KV_CACHE_MB if self.kv_cache_memory_mb is None else self.kv_cache_memory_mb

    def validate(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.weight_quant not in ("none", "int4"):
            raise ValueError(f"weight_quant must be none or int4, not {self.weight_quant!r}")
        if self.weight_quant == "int4" and self.dtype not in ("auto", "bfloat16"):
            raise ValueError("weight_quant int4 runs with bfloat16 activations: use dtype bfloat16 (or auto)")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto or int8, not {self.kv_cache_dtype!r}")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks must be positive")
        if self.kv_cache_memory_mb is not None and self.kv_cache_memory_mb <= 0:
            raise ValueError("kv_cache_memory_mb must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}")
