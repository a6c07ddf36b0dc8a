"""`--sweep FIELD=V1,V2,...`: one derived policy per value of a dotted policy field.

For the in-process gateway the derived policies are written as YAML files into a temporary policy
directory (a copy of the real one plus the variants), so each value is a real policy the gateway
loads and validates. Against a remote gateway (`--url`) the value travels as a request override
(`ctxgate.overrides`), which the policy must permit via `allow_request_overrides`.
"""

from __future__ import annotations

import copy
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class SweepSpec:
    field: str
    values: tuple[Any, ...]

    def label(self, value: Any) -> str:
        return f"{self.field}={value}"


def parse_sweep(spec: str) -> SweepSpec:
    """'documents.max_tokens=100,200' -> SweepSpec('documents.max_tokens', (100, 200)); values are
    parsed as YAML scalars so numbers, booleans and null keep their types."""
    if "=" not in spec:
        raise ValueError(f"--sweep '{spec}': expected FIELD=V1,V2,... e.g. documents.max_tokens=100,200")
    field_name, _, raw_values = spec.partition("=")
    field_name = field_name.strip()
    if not _FIELD.match(field_name):
        raise ValueError(f"--sweep '{spec}': '{field_name}' is not a dotted policy field name")
    values = tuple(yaml.safe_load(value.strip()) for value in raw_values.split(",") if value.strip())
    if not values:
        raise ValueError(f"--sweep '{spec}': no values given")
    if len(set(map(str, values))) != len(values):
        raise ValueError(f"--sweep '{spec}': values repeat")
    return SweepSpec(field_name, values)


@dataclass(frozen=True)
class PolicyVariant:
    """One arm of a run: the policy name sent to the gateway and how it was derived."""

    label: str  # how the report names this arm
    policy: str  # the policy name in the request
    base_policy: str
    sweep_field: str | None = None
    sweep_value: Any = None
    overrides: dict[str, Any] = field(default_factory=dict)


def default_policy_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "policies"


def load_policy_files(policy_dir: str | Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Policy name -> (file, raw YAML mapping) for every *.yaml / *.yml in the directory."""
    found: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path in sorted(Path(policy_dir).glob("*.y*ml")):
        raw = yaml.safe_load(path.read_text())
        if isinstance(raw, dict):
            found[str(raw.get("name") or path.stem)] = (path, raw)
    return found


def set_dotted(mapping: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    updated = copy.deepcopy(mapping)
    node = updated
    *parents, leaf = dotted.split(".")
    for key in parents:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ValueError(f"policy field '{dotted}': '{key}' is not a section")
        node = child
    node[leaf] = value
    return updated


def variant_policy_name(base: str, spec: SweepSpec, value: Any) -> str:
    # Policy names allow [A-Za-z0-9_.-] only.
    safe_value = re.sub(r"[^A-Za-z0-9_.-]", "_", str(value))
    return f"{base}--{spec.field}-{safe_value}"


def _validate(raw: dict[str, Any], where: str) -> None:
    from pydantic import ValidationError

    from ctxgate.policies.schema import Policy

    try:
        Policy.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        location = ".".join(str(part) for part in first["loc"]) or "(policy)"
        raise ValueError(f"{where}: field '{location}': {first['msg']}") from exc


def plain_variants(policies: list[str]) -> list[PolicyVariant]:
    return [PolicyVariant(label=name, policy=name, base_policy=name) for name in policies]


def build_sweep_variants(
    spec: SweepSpec, base_policy: str, policy_dir: str | Path | None, out_policy_dir: str | Path | None
) -> list[PolicyVariant]:
    """Derived variants of `base_policy`. With `out_policy_dir`, copy the policy dir there and write
    one YAML per value (in-process gateway); without it, produce request overrides (remote gateway)."""
    if out_policy_dir is None:
        return [
            PolicyVariant(
                label=spec.label(value),
                policy=base_policy,
                base_policy=base_policy,
                sweep_field=spec.field,
                sweep_value=value,
                overrides={spec.field: value},
            )
            for value in spec.values
        ]
    source_dir = Path(policy_dir) if policy_dir else default_policy_dir()
    policies = load_policy_files(source_dir)
    if base_policy not in policies:
        known = ", ".join(sorted(policies)) or "none"
        raise ValueError(f"--sweep: policy '{base_policy}' not found in {source_dir} (found: {known})")
    target = Path(out_policy_dir)
    target.mkdir(parents=True, exist_ok=True)
    for path, _ in policies.values():
        shutil.copy2(path, target / path.name)
    _, base_raw = policies[base_policy]
    variants = []
    for value in spec.values:
        name = variant_policy_name(base_policy, spec, value)
        derived = set_dotted(base_raw, spec.field, value)
        derived["name"] = name
        _validate(derived, f"--sweep {spec.label(value)} on policy '{base_policy}'")
        (target / f"{name}.yaml").write_text(yaml.safe_dump(derived, sort_keys=False))
        variants.append(
            PolicyVariant(
                label=spec.label(value),
                policy=name,
                base_policy=base_policy,
                sweep_field=spec.field,
                sweep_value=value,
            )
        )
    return variants
