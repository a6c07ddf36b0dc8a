"""Run a test file again in a child process with the CPU capped to a lesser kernel build, so the
AVX2 and portable paths are tested on an AVX-512 machine too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ctxgate.backend.platform.cpu_features import ISA_CAP_ENV, TORCH_ISA_CAPS

REPO = Path(__file__).resolve().parents[2]


def run_capped(
    isa: str, test_file: str, cache_dir: Path, keyword: str | None = None
) -> subprocess.CompletedProcess:
    """pytest on `test_file` with CTXGATE_CPU_ISA=`isa`, torch capped alike, kernels built into `cache_dir`."""
    env = {**os.environ, ISA_CAP_ENV: isa, "CTXGATE_CACHE_DIR": str(cache_dir), **TORCH_ISA_CAPS.get(isa, {})}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
    if keyword:
        command += ["-k", keyword]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
