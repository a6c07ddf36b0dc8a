"""What this x86 CPU can do, and which engine path follows from it: the one place that decides.

Every CPU-dependent choice of the engine reads `cpu_path()`: the ISA the C++ kernels are built for,
whether torch's oneDNN bfloat16 matmuls may be called (they raise on CPUs without AVX-512 BW/VL/DQ
or AVX-NE-CONVERT), what `--dtype auto` means, and how prefill multiplies. The choice is logged at
start-up, exported as the `ctxgate:cpu_info` metric, shown on `/v1/models` and written into every
benchmark report, so a figure always says which path produced it.

`CTXGATE_CPU_ISA` caps the detected features (`avx2`, `portable`); tests use it to run the AVX2
and portable paths on an AVX-512 machine, and a user can pin a path the same way.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import asdict, dataclass

# The /proc/cpuinfo flags that matter to the engine, in the kernel's spelling.
KNOWN_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "avx_ne_convert",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})
ISA_CAP_ENV = "CTXGATE_CPU_ISA"

# Kernel build targets, best first. Each names the compiler flags that produce it; `portable`
# compiles the plain C++ loops for baseline x86-64 (SSE2), which every x86-64 CPU runs.
KERNEL_ISAS = ("avx512_bf16", "avx2", "portable")
# The CPU features each build needs (skip messages name them).
ISA_FEATURES = {
    "avx512_bf16": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    "avx2": ("avx2", "fma", "f16c"),
    "portable": (),
}
# Environment that makes torch itself (ATen's vectorised kernels, oneDNN, MKL) stay within a capped
# ISA, so a child process capped to AVX2 runs what an AVX2-only CPU would run.
TORCH_ISA_CAPS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "portable": {
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    },
}
KERNEL_ISA_CFLAGS = {
    "avx512_bf16": ["-march=native"],
    "avx2": ["-march=haswell", "-mtune=generic"],
    "portable": ["-march=x86-64", "-mtune=generic"],
}


@dataclass(frozen=True)
class CPUPath:
    """The engine path chosen for this CPU."""

    model_name: str
    flags: tuple[str, ...]  # the KNOWN_FLAGS present (after any CTXGATE_CPU_ISA cap)
    kernel_isa: str  # avx512_bf16 | avx2 | portable
    onednn_bf16: bool  # torch's oneDNN bf16 matmul/reorder may be called
    auto_dtype: str  # what --dtype auto resolves to on CPU
    # How matmuls of more rows than a GEMV run with bfloat16 weights: "onednn_bf16" (native bf16
    # GEMM on prepacked weights) or "fp32_weights" (a one-time float32 copy through fp32 GEMM,
    # where bf16 GEMM would be emulated).
    prefill_matmul: str
    capped_by: str | None = None  # the CTXGATE_CPU_ISA value that capped detection, if any

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def missing(self, *flags: str) -> list[str]:
        return [flag for flag in flags if flag not in self.flags]

    def summary(self) -> str:
        cap = f" (capped by {ISA_CAP_ENV}={self.capped_by})" if self.capped_by else ""
        return (
            f"cpu path {self.kernel_isa}{cap}: kernels {self.kernel_isa}, dtype auto={self.auto_dtype}, "
            f"prefill matmul {self.prefill_matmul}; {self.model_name}; flags {' '.join(self.flags) or 'none'}"
        )

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "flags": list(self.flags)}


def read_cpu_flags() -> tuple[str, set[str]]:
    """The model name and flag set from /proc/cpuinfo (empty on other systems)."""
    model_name = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and value.strip():
                    model_name = value.strip()
                elif key in ("flags", "Features"):
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return model_name, flags


def _cap_flags(flags: set[str], cap: str) -> set[str]:
    if cap == "avx2":
        return flags & AVX2_FLAGS
    if cap == "portable":
        return set()
    raise ValueError(f"{ISA_CAP_ENV} must be avx2 or portable, not {cap!r}")


def choose_path(model_name: str, flags: set[str], capped_by: str | None = None) -> CPUPath:
    """Pure decision from a flag set, so every CPU kind's choice is testable on any machine."""
    known = tuple(flag for flag in KNOWN_FLAGS if flag in flags)
    avx512_core = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    if avx512_core and ("avx512_bf16" in flags or "amx_bf16" in flags):
        kernel_isa = "avx512_bf16"
    elif AVX2_FLAGS <= flags:
        kernel_isa = "avx2"
    else:
        kernel_isa = "portable"
    # torch refuses oneDNN bf16 reorders/GEMMs without these (mkldnn_bf16_device_check).
    onednn_bf16 = avx512_core or "avx_ne_convert" in flags
    native_bf16_gemm = kernel_isa == "avx512_bf16"
    # bfloat16 weights halve the bytes a decode step streams; the C++ kernels compute in fp32 on
    # AVX2 (bf16 -> fp32 is a 16-bit shift), so only the portable path stays in float32.
    auto_dtype = "bfloat16" if kernel_isa in ("avx512_bf16", "avx2") else "float32"
    return CPUPath(
        model_name=model_name,
        flags=known,
        kernel_isa=kernel_isa,
        onednn_bf16=onednn_bf16 and native_bf16_gemm,
        auto_dtype=auto_dtype,
        prefill_matmul="onednn_bf16" if native_bf16_gemm else "fp32_weights",
        capped_by=capped_by,
    )


@functools.cache
def cpu_path() -> CPUPath:
    """The path for this process (detected once; CTXGATE_CPU_ISA read at first call)."""
    model_name, flags = read_cpu_flags()
    cap = os.environ.get(ISA_CAP_ENV, "").strip().lower() or None
    if cap in ("native", "auto"):
        cap = None
    if cap is not None:
        flags = _cap_flags(flags, cap)
    return choose_path(model_name, flags, cap)


def runnable_kernel_isas() -> list[str]:
    """Kernel builds this machine can execute: its own and every weaker one."""
    best = cpu_path().kernel_isa
    return list(KERNEL_ISAS[KERNEL_ISAS.index(best) :])


def onednn_packing_available() -> bool:
    """torch can pack a bf16 weight for oneDNN once (`_reorder_linear_weight`) and reuse it."""
    import torch  # lazily: this module stays import-light

    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
