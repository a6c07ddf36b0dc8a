"""Engine configuration: the pydantic models behind the engine's flags, its config-file section
(`engine:`) and the benchmarks. Each field's name, default, constraint and help are defined here once;
`backend/settings/flags.py` turns them into flags."""

from __future__ import annotations

import os
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from ctxgate.backend.settings.flags import Cli

DEFAULT_CPU_KV_CACHE_MB = 256


def _known_device(value: str) -> str:
    if value not in ("auto", "cpu", "cuda") and not value.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu or cuda, not {value!r}")
    return value


class EngineConfig(BaseModel):
    """The built-in engine's configuration."""

    model_config = ConfigDict(extra="forbid")
    # Flags of one group may not be given together (argparse refuses; the model validator too).
    EXCLUSIVE: ClassVar[tuple[tuple[str, ...], ...]] = (("num_kv_blocks", "kv_cache_memory_mb"),)

    model: str | None = Field(
        default=None,
        description="a GGUF file (converted once into the cache) or a Hugging Face model directory of a Llama, "
        "Mistral, Qwen2 or SmolLM model; default: the packaged SmolLM2-135M (converted on first use)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="weight and activation dtype; auto: what backend/platform/cpu_features.py chooses for this CPU "
        "(bfloat16 with AVX-512 BF16 or AVX2 kernels, else float32), bfloat16 on CUDA",
    )
    device: Annotated[str, AfterValidator(_known_device)] = Field(
        default="auto", description="auto (cuda when torch sees a GPU), cpu, cuda or cuda:N"
    )
    block_size: int = Field(default=16, ge=1, description="tokens per KV-cache block")
    num_kv_blocks: int | None = Field(
        default=None, ge=1, description="KV blocks in the pool; default: derived from kv_cache_memory_mb"
    )
    kv_cache_memory_mb: int | None = Field(
        default=None,
        ge=1,
        description="KV pool size in MiB; default: 256 on CPU, on CUDA what gpu_memory_utilization leaves "
        "after the weights",
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="CUDA: the fraction of the GPU's total memory the engine may hold (weights, activations, "
        "KV pool), like vLLM's; what other processes already use counts against it too",
    )
    cuda_graphs: bool | None = Field(
        default=None,
        description="decode through captured CUDA graphs: unset = on where they run (CUDA, the cuda attention "
        "backend, 16/32-bit KV); true = required (a start-up error where they cannot run); false = off",
    )
    cpu_decode_graphs: bool | None = Field(
        default=None,
        description="CPU: decode steps traced into TorchScript, one per padded batch size: unset = on where "
        "they run (the C++ kernels, bfloat16 weights and KV); true = required; false = off",
    )
    kv_cache_dtype: Literal["auto", "int8"] = Field(
        default="auto",
        description="KV cache storage; auto: the model dtype; int8 halves its memory (per-block, per-head "
        "scales) for a small accuracy cost",
    )
    weight_quant: Literal["none", "int4"] = Field(
        default="none",
        description="int4: decode-sized matmuls read 4-bit weights (groups of 32, asymmetric; bfloat16 "
        "activations, prefill keeps bfloat16); the default model ships as Q4_1, which int4 reproduces",
    )
    max_num_batched_tokens: int = Field(default=512, ge=1, description="token budget of one engine step")
    max_num_seqs: int = Field(default=32, ge=1, description="sequences scheduled in one engine step at most")
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        description="context window in tokens; default: the smaller of the model's and 8192",
    )
    enable_prefix_caching: Annotated[bool, Cli(old=("--prefix-caching",))] = Field(
        default=True,
        description="reuse the KV blocks of a prompt prefix already computed (automatic prefix caching)",
    )
    ttft_target_ms: float = Field(
        default=1500.0, gt=0, description="time-to-first-token target the scheduler plans prefill for"
    )
    fair_queuing: bool = Field(
        default=True,
        description="order waiting requests by weighted fair queuing between tenants on prefill tokens "
        "(each tenant's keys-file weight), inside each priority class; false: first come, first served",
    )
    interleaved_prefill_tokens: int = Field(
        default=128,
        ge=0,
        description="CPU: a waiting user request whose uncached prompt is at most this many tokens, first "
        "in line and of a tenant with no prefill in the step in progress, is prefilled alone between two "
        "decoder layers of that step and gets its first token at once; also the most such tokens per "
        "step; 0: off (it waits for the step's end)",
    )
    num_threads: Annotated[int | None, Cli(old=("--threads",))] = Field(
        default=None, ge=1, description="torch CPU threads; default: every core"
    )
    attention_backend: str = Field(
        default="auto",
        description="attention implementation: auto (cuda on a GPU, cpu_batched on CPU), reference, "
        "cpu_batched or cuda",
    )

    @property
    def cpu_kv_cache_memory_mb(self) -> int:
        return DEFAULT_CPU_KV_CACHE_MB if self.kv_cache_memory_mb is None else self.kv_cache_memory_mb

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.weight_quant == "int4" and self.dtype not in ("auto", "bfloat16"):
            raise ValueError("weight_quant int4 runs with bfloat16 activations: use dtype bfloat16 (or auto)")
        for names in self.EXCLUSIVE:
            if sum(getattr(self, name) is not None for name in names) > 1:
                raise ValueError(f"set {' or '.join(names)}, not both")
        return self

    def validate(self) -> None:  # type: ignore[override]  # pydantic's deprecated classmethod of this name
        """Check the current values (callers may have assigned fields since construction)."""
        type(self).model_validate(self.model_dump())


def _engine_api_key() -> str | None:
    return os.environ.get("CTXGATE_ENGINE_API_KEY") or None


class EngineServerSettings(BaseModel):
    """`ctxgate engine serve`: the HTTP server around the engine (the engine itself: EngineConfig)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8001, ge=1, le=65535, description="TCP port to listen on")
    served_model_name: str | None = Field(default=None, description="model id reported by the API")
    max_waiting_requests: int | None = Field(
        default=None, ge=1, description="refuse new requests with 503 when this many are already waiting"
    )
    vllm_metric_names: bool = Field(
        default=False,
        description="also export the engine's metrics under vLLM's names (vllm:num_requests_waiting, ...)",
    )
    api_key: str | None = Field(
        default_factory=_engine_api_key,
        repr=False,
        description="require 'Authorization: Bearer KEY' on /v1 routes (default $CTXGATE_ENGINE_API_KEY)",
    )
    drop_params: bool = Field(
        default=False, description="drop request fields the engine cannot honour instead of answering 400"
    )
