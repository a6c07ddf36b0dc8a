"""Builds and loads the C++ decode kernels (backend/model/csrc/cpu_kernels.cpp) once per machine.

The kernels are compiled with the local C++ compiler through torch.utils.cpp_extension the first
time they are needed (about 30 s) for the ISA `ctxgate.backend.platform.cpu_features` chose (AVX-512 BF16, AVX2 or
portable x86-64), and cached under the ctxgate cache folder keyed by the source hash and that ISA,
so later engine starts load the built library in milliseconds. Where no compiler is present, or
with CTXGATE_CPU_KERNELS=0, the engine keeps its pure-PyTorch paths (slower, same results up to
floating-point rounding).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
_lock = threading.Lock()
_loaded: bool | None = None  # None until the first load()


def kernel_isa() -> str:
    """The ISA the kernels are built for on this machine (see ctxgate.backend.platform.cpu_features)."""
    from ctxgate.backend.platform.cpu_features import cpu_path

    return cpu_path().kernel_isa


def _compile_flags() -> list[str]:
    from ctxgate.backend.platform.cpu_features import KERNEL_ISA_CFLAGS

    return KERNEL_ISA_CFLAGS[kernel_isa()]


def _build_dir() -> Path:
    from ctxgate.backend.model.model_prepare import cache_dir
    from ctxgate.backend.platform.cpu_features import cpu_path

    # -march=native depends on the CPU itself, so its flags are part of the key: a cache folder
    # shared with (or copied to) another CPU type must not reuse the library.
    key = b"|".join(
        [
            SOURCE.read_bytes(),
            torch.__version__.encode(),
            " ".join(_compile_flags()).encode(),
            " ".join(cpu_path().flags).encode(),
        ]
    )
    return cache_dir() / "kernels" / f"cpu-{kernel_isa()}-{hashlib.sha256(key).hexdigest()[:16]}"


def disabled_by_env() -> bool:
    return os.environ.get("CTXGATE_CPU_KERNELS", "1").lower() in ("0", "false", "no", "off")


def load() -> bool:
    """Compile (first time) and load the kernels; False when unavailable. Thread-safe, cached."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load_uncached()
        return _loaded


def _load_uncached() -> bool:
    if disabled_by_env():
        logger.info("CPU kernels disabled by CTXGATE_CPU_KERNELS=0")
        return False
    build_dir = _build_dir()
    if _load_prebuilt(build_dir / "ctxgate_cpu_kernels.so"):
        return True
    _put_ninja_on_path()
    try:
        from torch.utils.cpp_extension import load as load_extension

        build_dir.mkdir(parents=True, exist_ok=True)
        load_extension(
            name="ctxgate_cpu_kernels",
            sources=[str(SOURCE)],
            build_directory=str(build_dir),
            # -fopenmp makes at::parallel_for use threads; the library resolves libgomp.so.1 to
            # the copy torch already loaded, so there is one OpenMP runtime and one thread pool.
            extra_cflags=["-O3", *_compile_flags(), "-fno-math-errno", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers, build error: fall back
        logger.warning("CPU kernels unavailable, using the PyTorch paths: %s", str(exc).splitlines()[0][:300])
        return False
    loaded = hasattr(torch.ops, "ctxgate_cpu") and hasattr(torch.ops.ctxgate_cpu, "gemv_bf16")
    if loaded:
        logger.info("CPU kernels loaded (%s build)", kernel_isa())
    return loaded


def _load_prebuilt(library: Path) -> bool:
    """The library an earlier build left in this key's folder (same source, torch, flags and CPU),
    loaded without a compiler: what lets an image ship kernels but no g++. A damaged file is rebuilt."""
    if not library.exists():
        return False
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        logger.warning("prebuilt CPU kernels at %s did not load (%s); rebuilding", library.parent.name, exc)
        return False
    loaded = hasattr(torch.ops, "ctxgate_cpu") and hasattr(torch.ops.ctxgate_cpu, "gemv_bf16")
    if loaded:
        logger.info("CPU kernels loaded (%s build, prebuilt)", kernel_isa())
    return loaded


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip-installed one lives in the venv's bin, which is not on
    PATH when the venv's python is run directly (as `make test` does)."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    path = os.environ.get("PATH", "")
    if bin_dir and bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path
