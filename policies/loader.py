"""Load policy YAML files, report errors by file and field, and keep a hot-reloadable registry.

The registry is polled (stat every `interval`) rather than driven by inotify so that it behaves the
same on every filesystem, including bind mounts and network volumes where inotify misses edits.
An invalid edit never replaces the policy in force: the old one stays and the error is recorded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ctxgate.policies.schema import Policy
from ctxgate.policies.suggest import field_suggestion

logger = logging.getLogger(__name__)

POLICY_SUFFIXES = (".yaml", ".yml")


def packaged_policy_dir() -> Path:
    """The directory holding the policies shipped with ctxgate (package data)."""
    return Path(__file__).resolve().parent


class PolicyFileError(ValueError):
    """A policy file that cannot be used; the message names the file, the field and the reason."""

    def __init__(self, path: str | Path, problems: list[tuple[str, str]]):
        self.path = str(path)
        self.problems = problems
        lines = [
            f"{self.path}: field '{loc}': {reason}" if loc else f"{self.path}: {reason}"
            for loc, reason in problems
        ]
        super().__init__("\n".join(lines))


def _problems_from_validation(exc: ValidationError) -> list[tuple[str, str]]:
    problems = []
    for error in exc.errors():
        loc = ".".join(str(part) for part in error.get("loc", ()))
        message = error.get("msg", "invalid value")
        if "input" in error and error.get("type") not in ("missing",):
            message = f"{message} (got {json.dumps(error['input'], default=str)[:80]})"
        if error.get("type") == "extra_forbidden":
            hint = field_suggestion(Policy, error.get("loc", ()))
            message = f"{message}; {hint}" if hint else message
        problems.append((loc, message))
    return problems


def parse_policy(data: Any, source: str | Path = "<policy>") -> Policy:
    if not isinstance(data, dict):
        raise PolicyFileError(source, [("", "a policy must be a YAML mapping of fields to values")])
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyFileError(source, _problems_from_validation(exc)) from None


def load_policy_file(path: str | Path) -> Policy:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyFileError(path, [("", f"cannot read file: {exc.strerror or exc}")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or str(exc)
        raise PolicyFileError(path, [("", f"invalid YAML{where}: {reason}")]) from None
    return parse_policy(data, path)


def apply_overrides(policy: Policy, overrides: dict[str, Any]) -> Policy:
    """A copy of `policy` with dotted-field overrides applied; only fields the policy allows.

    Raises ValueError naming the field when it is not allowed or the value is invalid.
    """
    if not overrides:
        return policy
    data = policy.model_dump()
    for dotted, value in overrides.items():
        if dotted not in policy.allow_request_overrides:
            raise ValueError(
                f"policy '{policy.name}' does not allow overriding '{dotted}' "
                f"(allowed: {', '.join(policy.allow_request_overrides) or 'none'})"
            )
        target = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            if not isinstance(target.get(part), dict):
                raise ValueError(f"unknown policy field '{dotted}'")
            target = target[part]
        if parts[-1] not in target:
            raise ValueError(f"unknown policy field '{dotted}'")
        target[parts[-1]] = value
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        problems = _problems_from_validation(exc)
        raise ValueError("; ".join(f"{loc}: {reason}" for loc, reason in problems)) from None


@dataclass
class LoadedPolicy:
    policy: Policy
    path: str
    loaded_at: float


@dataclass
class ReloadError:
    path: str
    message: str
    at: float


@dataclass
class _FileState:
    signature: str
    policy_name: str | None = None


@dataclass
class PolicyRegistry:
    """Policies by name from one or more directories; later directories win on name clashes."""

    directories: list[Path]
    on_reload_failure: Callable[[ReloadError], None] | None = None
    on_reload: Callable[[LoadedPolicy], None] | None = None
    _policies: dict[str, LoadedPolicy] = field(default_factory=dict)
    _files: dict[str, _FileState] = field(default_factory=dict)
    _errors: dict[str, ReloadError] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.directories = [Path(d) for d in self.directories]
        for directory in self.directories:
            if not directory.is_dir():
                raise FileNotFoundError(f"policy directory not found: {directory}")
        self.refresh()

    # -- reading -------------------------------------------------------------------------------
    def get(self, name: str) -> Policy | None:
        loaded = self._policies.get(name)
        return loaded.policy if loaded else None

    def names(self) -> list[str]:
        return sorted(self._policies)

    def loaded(self) -> list[LoadedPolicy]:
        return [self._policies[name] for name in sorted(self._policies)]

    def errors(self) -> list[ReloadError]:
        return sorted(self._errors.values(), key=lambda err: err.at)

    @property
    def last_error(self) -> ReloadError | None:
        errors = self.errors()
        return errors[-1] if errors else None

    # -- reloading -----------------------------------------------------------------------------
    def _policy_files(self) -> list[Path]:
        files: list[Path] = []
        for directory in self.directories:
            files.extend(
                sorted(p for p in directory.iterdir() if p.suffix in POLICY_SUFFIXES and p.is_file())
            )
        return files

    def refresh(self) -> bool:
        """Re-read changed files; returns True when anything changed. Safe to call often."""
        with self._lock:
            return self._refresh_locked()

    def _refresh_locked(self) -> bool:
        changed = False
        seen: set[str] = set()
        for path in self._policy_files():
            key = str(path)
            seen.add(key)
            try:
                # Content, not mtime: coarse filesystem timestamps can hide two quick edits.
                signature = hashlib.sha256(path.read_bytes()).hexdigest()
            except OSError:
                continue
            state = self._files.get(key)
            if state is not None and state.signature == signature:
                continue
            changed = True
            self._load_one(path, signature, previous=state)
        for key in list(self._files):
            if key not in seen:  # a deleted file takes its policy with it
                state = self._files.pop(key)
                self._errors.pop(key, None)
                if state.policy_name and self._policies.get(state.policy_name, None):
                    if self._policies[state.policy_name].path == key:
                        del self._policies[state.policy_name]
                        logger.info("policy %s removed (file %s deleted)", state.policy_name, key)
                changed = True
        return changed

    def _load_one(self, path: Path, signature: str, previous: _FileState | None) -> None:
        key = str(path)
        try:
            policy = load_policy_file(path)
            owner = self._policies.get(policy.name)
            if owner is not None and owner.path != key and Path(owner.path).parent == path.parent:
                raise PolicyFileError(
                    path, [("name", f"policy '{policy.name}' is already defined in {owner.path}")]
                )
        except PolicyFileError as exc:
            error = ReloadError(path=key, message=str(exc), at=time.time())
            self._errors[key] = error
            # Keep the old signature's policy in force; remember the new signature so an unchanged
            # broken file is not re-reported every poll.
            self._files[key] = _FileState(signature, previous.policy_name if previous else None)
            logger.error("policy reload failed, keeping the policy in force: %s", exc)
            if self.on_reload_failure:
                self.on_reload_failure(error)
            return
        if previous and previous.policy_name and previous.policy_name != policy.name:
            old = self._policies.get(previous.policy_name)
            if old and old.path == key:
                del self._policies[previous.policy_name]
        loaded = LoadedPolicy(policy=policy, path=key, loaded_at=time.time())
        self._policies[policy.name] = loaded
        self._files[key] = _FileState(signature, policy.name)
        self._errors.pop(key, None)
        logger.info("policy %s loaded from %s", policy.name, key)
        if self.on_reload:
            self.on_reload(loaded)
