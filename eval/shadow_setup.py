"""What the shadow commands (`ctxgate eval shadow-agreement`, `ctxgate bench shadow`) share: a policy
directory where one policy has a `shadow:` section, and the gateway's shadow summary read over HTTP.

The policy is derived from the one an operator runs (the shipped file, or one of `--policy-dir`), so
a shadow figure is about that policy's compression and nothing else.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from ctxgate.policies.loader import POLICY_SUFFIXES, packaged_policy_dir


def policy_source(policy: str, policy_dir: str | Path | None) -> Path:
    """The file `policy` is read from: the operator's directory first, as the gateway does."""
    for directory in ([Path(policy_dir)] if policy_dir else []) + [packaged_policy_dir()]:
        for suffix in POLICY_SUFFIXES:
            candidate = directory / f"{policy}{suffix}"
            if candidate.is_file():
                return candidate
    raise ValueError(f"policy '{policy}' not found in {policy_dir or 'the shipped policies'}")


def shadowed_policy(source: Path, name: str, shadow: dict[str, Any]) -> dict[str, Any]:
    """The policy in `source`, renamed `name`, with `shadow` as its shadow section."""
    data = yaml.safe_load(source.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{source}: not a policy mapping")
    return data | {"name": name, "shadow": shadow}


def write_policy_dir(target: Path, policy_dir: str | Path | None, derived: list[dict[str, Any]]) -> Path:
    """`target` holding the operator's policy files (if any) and the derived policies, each in
    `<name>.yaml` (one of the operator's files by that name is replaced)."""
    target.mkdir(parents=True, exist_ok=True)
    names = {policy["name"] for policy in derived}
    if policy_dir:
        for path in sorted(Path(policy_dir).iterdir()):
            if path.suffix in POLICY_SUFFIXES and path.is_file() and path.stem not in names:
                shutil.copy(path, target / path.name)
    for policy in derived:
        (target / f"{policy['name']}.yaml").write_text(yaml.safe_dump(policy, sort_keys=False))
    return target


@dataclass(frozen=True)
class ShadowCounts:
    """One policy's counters in `/v1/ctxgate/shadow`."""

    sampled: int = 0
    comparisons: int = 0
    mean_agreement: float | None = None
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def settled(self) -> int:
        """Sampled requests that are compared or dropped (not running any more)."""
        return self.comparisons + sum(self.dropped.values())

    def since(self, earlier: ShadowCounts) -> ShadowCounts:
        """What happened between `earlier` and this reading (the mean is not differenced)."""
        reasons = self.dropped.keys() | earlier.dropped.keys()
        dropped = {r: self.dropped.get(r, 0) - earlier.dropped.get(r, 0) for r in sorted(reasons)}
        return ShadowCounts(
            sampled=self.sampled - earlier.sampled,
            comparisons=self.comparisons - earlier.comparisons,
            dropped={reason: count for reason, count in dropped.items() if count},
        )


def counts_of(summary: dict[str, Any], policy: str) -> ShadowCounts:
    for item in summary.get("policies", []):
        if item.get("policy") == policy:
            return ShadowCounts(
                sampled=int(item.get("sampled", 0)),
                comparisons=int(item.get("comparisons", 0)),
                mean_agreement=item.get("mean_agreement"),
                dropped={str(k): int(v) for k, v in (item.get("dropped") or {}).items()},
            )
    return ShadowCounts()


async def read_counts(client: httpx.AsyncClient, url: str, policy: str) -> ShadowCounts:
    response = await client.get(url + "/v1/ctxgate/shadow")
    response.raise_for_status()
    return counts_of(response.json(), policy)
