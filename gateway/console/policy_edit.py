"""A policy edit from the console: validated exactly as `ctxgate policy check` validates a file
(`load_policy_file`), then saved atomically, or refused with the loader's error and nothing changed.

The edit is written to a hidden temporary file beside the target (a name the registry never loads),
checked there, and renamed over the target only when it loads; a running gateway never reads half a
file, and a bad edit never reaches the policy directory.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ctxgate.policies.loader import PolicyFileError, PolicyRegistry, load_policy_file


class PolicyEditError(ValueError):
    """An edit that was not saved; the message is what `ctxgate policy check` would print."""


@dataclass(frozen=True)
class SavedPolicy:
    file: str
    name: str


def target_file(policy_dir: Path | None, file: str, editable: list[str]) -> Path:
    """The file in policy_dir this edit replaces: one of the listed names, nothing else."""
    if policy_dir is None:
        raise PolicyEditError("no policy_dir is configured (server.policy_dir): nothing to edit")
    if file not in editable:
        raise PolicyEditError(f"field 'file': '{file[:80]}' is not a policy file in the policy directory")
    return policy_dir / file


def save_policy(target: Path, text: str, registry: PolicyRegistry) -> SavedPolicy:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".console.tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            if target.exists():
                os.fchmod(handle.fileno(), target.stat().st_mode & 0o777)
            os.fsync(handle.fileno())
        try:
            policy = load_policy_file(tmp)
        except PolicyFileError as exc:
            raise PolicyEditError(str(exc).replace(tmp, target.name)) from None
        _check_name_free(policy.name, target, registry)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return SavedPolicy(target.name, policy.name)


def _check_name_free(name: str, target: Path, registry: PolicyRegistry) -> None:
    """The registry refuses a second file of the same policy name in one directory: so does the edit."""
    for item in registry.loaded():
        other = Path(item.path)
        if item.policy.name == name and other.parent.resolve() == target.parent.resolve():
            if other.name != target.name:
                raise PolicyEditError(
                    f"{target.name}: field 'name': policy '{name}' is already defined in {other.name}"
                )
