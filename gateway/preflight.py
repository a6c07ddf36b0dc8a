"""What `ctxgate serve` checks before loading a model, and `ctxgate config check` reports.

Loading the model takes seconds to minutes; a misspelt keys file, a missing policy folder or a
broken policy found only afterwards wastes all of it. Each check here reads files only (no torch,
no model), so a bad configuration fails in well under a second, with every problem listed at once.
"""

from __future__ import annotations

from pathlib import Path

from ctxgate.backend.engine.config import EngineConfig
from ctxgate.gateway.console.admin_key import admin_key_problems
from ctxgate.gateway.keys import read_keys_file
from ctxgate.gateway.model_list_config import builtin_needed
from ctxgate.gateway.settings import GatewaySettings
from ctxgate.policies.loader import PolicyFileError, load_policy_file, packaged_policy_dir

POLICY_SUFFIXES = (".yaml", ".yml")
# Model names the engine resolves itself (the packaged model): not paths to check.
_BUILTIN_MODEL_NAMES = ("", "default", "SmolLM2-135M-Instruct")


def keys_file_problems(path: Path | None) -> list[str]:
    where = "field 'server.keys_file' (--keys-file)"
    if path is None:
        return []
    if not path.exists():
        return [
            f"{where}: keys file not found: {path} (create it with `ctxgate keys add TENANT --keys-file {path}`)"
        ]
    try:
        read_keys_file(path)
    except ValueError as exc:
        return [f"{where}: {exc}"]
    return []


def policy_problems(settings: GatewaySettings) -> list[str]:
    """The policy folder exists and every policy in it loads; the default policy is among them."""
    directories = [packaged_policy_dir()] if settings.include_packaged_policies else []
    problems = []
    if settings.policy_dir is not None:
        if not settings.policy_dir.is_dir():
            return [
                f"field 'server.policy_dir' (--policy-dir): policy folder not found: {settings.policy_dir}"
            ]
        directories.append(settings.policy_dir)
    names = set()
    for directory in directories:
        for path in sorted(directory.iterdir()):
            if path.suffix not in POLICY_SUFFIXES or path.name.startswith("."):
                continue
            try:
                names.add(load_policy_file(path).name)
            except PolicyFileError as exc:
                problems.append(str(exc))
    if names and settings.default_policy not in names:
        problems.append(
            f"field 'server.default_policy' (--default-policy): no policy named '{settings.default_policy}' "
            f"(loaded: {', '.join(sorted(names))})"
        )
    return problems


def model_problems(model: str | None) -> list[str]:
    """A local model path exists (a GGUF file, or a folder with config.json)."""
    if model is None or model in _BUILTIN_MODEL_NAMES:
        return []
    where = "field 'engine.model' (--model)"
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        return [] if path.is_file() else [f"{where}: GGUF file not found: {path}"]
    if not (path / "config.json").is_file():
        return [f"{where}: {path} is neither a GGUF file nor a Hugging Face model folder (no config.json)"]
    return []


def preflight_problems(settings: GatewaySettings, engine: EngineConfig) -> list[str]:
    """Every problem with the files this configuration names, one line each (empty: fine)."""
    problems = keys_file_problems(settings.keys_file) + policy_problems(settings)
    problems += admin_key_problems(settings.admin_key_file)
    if builtin_needed(settings.model_list, settings.upstreams):
        problems += model_problems(engine.model)
    return problems
