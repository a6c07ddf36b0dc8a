"""The policies in force (name, file, when loaded) and the files whose last edit failed to load;
file names only, never the server's directories."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ctxgate.policies.loader import PolicyRegistry


@dataclass(frozen=True)
class PolicyRow:
    name: str
    file: str
    loaded_at: float
    editable: bool  # in the operator's policy_dir (the packaged ones are not edited here)
    max_input_tokens: int
    adaptive: bool


@dataclass(frozen=True)
class ReloadErrorRow:
    file: str
    message: str
    at: float


@dataclass(frozen=True)
class PoliciesView:
    policies: list[PolicyRow]
    errors: list[ReloadErrorRow]
    editable_files: list[str]


def strip_directories(message: str, directories: list[Path]) -> str:
    for directory in directories:
        message = message.replace(f"{directory}{os.sep}", "")
    return message


def editable_files(policy_dir: Path | None) -> list[str]:
    """The policy files an operator may edit here: the YAML files directly in policy_dir."""
    if policy_dir is None or not policy_dir.is_dir():
        return []
    return sorted(p.name for p in policy_dir.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())


def policies_view(registry: PolicyRegistry, policy_dir: Path | None) -> PoliciesView:
    editable_dir = policy_dir.resolve() if policy_dir is not None else None
    rows = [
        PolicyRow(
            name=item.policy.name,
            file=os.path.basename(item.path),
            loaded_at=item.loaded_at,
            editable=editable_dir is not None and Path(item.path).resolve().parent == editable_dir,
            max_input_tokens=item.policy.max_input_tokens,
            adaptive=item.policy.adaptive.enabled,
        )
        for item in registry.loaded()
    ]
    errors = [
        ReloadErrorRow(
            os.path.basename(err.path), strip_directories(err.message, registry.directories), err.at
        )
        for err in registry.errors()
    ]
    return PoliciesView(rows, errors, editable_files(policy_dir))
