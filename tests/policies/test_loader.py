"""Policy files: the shipped ones are valid; errors name the file, the field and the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ctxgate.policies.loader import (
    PolicyFileError,
    PolicyRegistry,
    apply_overrides,
    load_policy_file,
    packaged_policy_dir,
)

REPO = Path(__file__).resolve().parents[2]
SHIPPED = [
    "passthrough",
    "rag-default",
    "rag-strict",
    "chat-long-history",
    "rag-multihop",
    "rag-fast",
    "rag-adaptive",
]


def _ctxgate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ctxgate", *args], capture_output=True, text=True, cwd=REPO, timeout=60
    )


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_policies_are_valid(name):
    policy = load_policy_file(packaged_policy_dir() / f"{name}.yaml")
    assert policy.name == name
    assert policy.documents.max_tokens <= policy.max_input_tokens


def test_rag_fast_is_rag_default_with_a_smaller_first_sight_allowance():
    fast = load_policy_file(packaged_policy_dir() / "rag-fast.yaml")
    default = load_policy_file(packaged_policy_dir() / "rag-default.yaml")
    assert fast.documents.embed_budget_multiple < default.documents.embed_budget_multiple
    assert fast.documents.embed_min_share < default.documents.embed_min_share
    same = {"name", "description", "documents", "allow_request_overrides"}
    assert fast.model_dump(exclude=same) == default.model_dump(exclude=same)
    allowance = {"embed_budget_multiple", "embed_min_share"}
    assert fast.documents.model_dump(exclude=allowance) == default.documents.model_dump(exclude=allowance)


def test_passthrough_disables_compression_but_keeps_a_budget():
    policy = load_policy_file(packaged_policy_dir() / "passthrough.yaml")
    assert not policy.compression_enabled
    assert policy.max_input_tokens >= 8192


@pytest.mark.parametrize(
    "text, field, reason",
    [
        ("name: x\nmax_input_tokens: -5\n", "max_input_tokens", "greater than or equal"),
        ("name: x\ndocuments: {max_tokens: 9000}\n", "", "documents.max_tokens cannot exceed"),
        (
            "name: x\nrerank: {methd: bm25}\n",
            "rerank.methd",
            "Extra inputs are not permitted (got \"bm25\"); did you mean 'method'?",
        ),
        ("name: x\nextraction: {neighbors: 1}\n", "extraction.neighbors", "did you mean 'neighbours'?"),
        ("name: x\nmax_input_token: 100\n", "max_input_token", "did you mean 'max_input_tokens'?"),
        ("name: x\nquota: {on_store_error: maybe}\n", "quota.on_store_error", "'allow' or 'deny'"),
        ("max_input_tokens: 100\n", "name", "Field required"),
        (
            "name: x\ndocuments: {embed_budget_multiple: 0}\n",
            "documents.embed_budget_multiple",
            "greater than 0",
        ),
        (
            "name: x\ndocuments: {embed_min_share: 1.5}\n",
            "documents.embed_min_share",
            "less than or equal to 1",
        ),
        (
            "name: x\nadaptive: {floor_tokens: 900, ceiling_tokens: 300}\n",
            "adaptive",
            "floor_tokens cannot exceed",
        ),
        ("name: x\nadaptive: {enabled: true, ceiling_tokens: 4000}\n", "", "ceiling_tokens cannot exceed"),
        ("name: x\nadaptive: {ttft_slo_s: 0}\n", "adaptive.ttft_slo_s", "greater than 0"),
        ("name: x\nadaptive: {headroom: 1.5}\n", "adaptive.headroom", "less than or equal to 1"),
        (
            "name: x\nadaptive: {step_tokens: 1, ceiling_tokens: 2000}\n",
            "adaptive",
            "more than 256 candidate",
        ),
        ("name: x\nadaptive: {slo: 2}\n", "adaptive.slo", "Extra inputs"),
        ("name: x\nextraction: {second_hop: auto}\n", "extraction.second_hop", "Extra inputs"),  # removed
        ("name: [unclosed\n", "", "invalid YAML at line"),
        ("- just\n- a list\n", "", "YAML mapping"),
    ],
)
def test_errors_name_file_field_and_reason(tmp_path, text, field, reason):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(PolicyFileError) as info:
        load_policy_file(path)
    message = str(info.value)
    assert str(path) in message
    if field:
        assert f"field '{field}'" in message
    assert reason in message


def test_an_unknown_field_without_a_close_match_suggests_nothing(tmp_path):
    path = tmp_path / "far.yaml"
    path.write_text("name: x\nrerank: {zzzz: 1}\n")
    with pytest.raises(PolicyFileError) as info:
        load_policy_file(path)
    assert str(info.value) == f"{path}: field 'rerank.zzzz': Extra inputs are not permitted (got 1)"


def test_policy_check_cli(tmp_path):
    good = _ctxgate("policy", "check", str(packaged_policy_dir() / "rag-default.yaml"))
    assert good.returncode == 0 and "ok (policy 'rag-default'" in good.stdout
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text("name: bad\nreserve_output_tokens: zero\n")
    bad = _ctxgate("policy", "check", str(bad_file))
    assert bad.returncode == 1
    assert f"{bad_file}: field 'reserve_output_tokens'" in bad.stderr
    assert "valid integer" in bad.stderr


def test_policy_schema_cli():
    result = _ctxgate("policy", "schema")
    schema = json.loads(result.stdout)
    assert {"max_input_tokens", "reserve_output_tokens", "history", "documents", "quota", "cost"} <= set(
        schema["properties"]
    )


def test_overrides_only_where_allowed():
    policy = load_policy_file(packaged_policy_dir() / "rag-default.yaml")
    changed = apply_overrides(policy, {"documents.max_tokens": 300})
    assert changed.documents.max_tokens == 300 and policy.documents.max_tokens == 560
    with pytest.raises(ValueError, match="does not allow"):
        apply_overrides(policy, {"max_input_tokens": 100000})
    with pytest.raises(ValueError, match="max_tokens"):
        apply_overrides(policy, {"documents.max_tokens": -1})


def test_registry_keeps_old_policy_on_invalid_edit(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("name: p\nmax_input_tokens: 500\ndocuments: {max_tokens: 100}\n")
    failures = []
    registry = PolicyRegistry([tmp_path], on_reload_failure=failures.append)
    assert registry.get("p").max_input_tokens == 500
    path.write_text("name: p\nmax_input_tokens: 600\ndocuments: {max_tokens: 100}\n")
    assert registry.refresh() and registry.get("p").max_input_tokens == 600
    path.write_text("name: p\nmax_input_tokens: lots\n")
    registry.refresh()
    assert registry.get("p").max_input_tokens == 600
    assert len(failures) == 1 and "max_input_tokens" in registry.last_error.message
    registry.refresh()  # an unchanged broken file is reported once
    assert len(failures) == 1
    path.write_text("name: p\nmax_input_tokens: 700\ndocuments: {max_tokens: 100}\n")
    registry.refresh()
    assert registry.get("p").max_input_tokens == 700 and registry.last_error is None
    path.unlink()
    registry.refresh()
    assert registry.get("p") is None


def test_duplicate_names_in_one_directory_are_reported(tmp_path):
    (tmp_path / "a.yaml").write_text("name: same\n")
    (tmp_path / "b.yaml").write_text("name: same\n")
    registry = PolicyRegistry([tmp_path])
    assert registry.get("same") is not None
    assert "already defined" in registry.last_error.message


def test_adaptive_section_is_overridable_per_request_only_where_allowed():
    adaptive = load_policy_file(packaged_policy_dir() / "rag-adaptive.yaml")
    assert adaptive.adaptive.enabled and adaptive.adaptive.floor_tokens < adaptive.documents.max_tokens
    relaxed = apply_overrides(adaptive, {"adaptive.ttft_slo_s": 5.0})
    assert relaxed.adaptive.ttft_slo_s == 5.0 and adaptive.adaptive.ttft_slo_s != 5.0
    with pytest.raises(ValueError, match="greater than 0"):
        apply_overrides(adaptive, {"adaptive.ttft_slo_s": -1})
    with pytest.raises(ValueError, match="does not allow overriding 'adaptive.floor_tokens'"):
        apply_overrides(adaptive, {"adaptive.floor_tokens": 0})
    default = load_policy_file(packaged_policy_dir() / "rag-default.yaml")
    assert not default.adaptive.enabled
    with pytest.raises(ValueError, match="does not allow overriding"):
        apply_overrides(default, {"adaptive.enabled": True})
