"""--sweep parsing and derived policy files."""

from __future__ import annotations

import pytest
import yaml

from ctxgate.eval.sweep import build_sweep_variants, load_policy_files, parse_sweep

BASE = {
    "name": "rag-test",
    "max_input_tokens": 1024,
    "documents": {"max_tokens": 600},
    "rerank": {"top_k": 5},
}


def test_parse_keeps_types():
    spec = parse_sweep("documents.max_tokens=100, 200,400")
    assert spec.field == "documents.max_tokens" and spec.values == (100, 200, 400)
    assert parse_sweep("rerank.enabled=true,false").values == (True, False)
    assert parse_sweep("rerank.top_k=null,3").values == (None, 3)


@pytest.mark.parametrize("bad", ["documents.max_tokens", "=1,2", "documents.max_tokens=", "a..b=1", "x=1,1"])
def test_parse_rejects_malformed(bad):
    with pytest.raises(ValueError, match="--sweep"):
        parse_sweep(bad)


def test_derived_policies_are_written_and_valid(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "rag-test.yaml").write_text(yaml.safe_dump(BASE))
    (source / "passthrough.yaml").write_text(yaml.safe_dump({"name": "passthrough"}))
    target = tmp_path / "derived"
    variants = build_sweep_variants(parse_sweep("documents.max_tokens=100,200"), "rag-test", source, target)
    assert [variant.label for variant in variants] == ["documents.max_tokens=100", "documents.max_tokens=200"]
    written = load_policy_files(target)
    assert {"rag-test", "passthrough", variants[0].policy, variants[1].policy} == set(written)
    assert written[variants[0].policy][1]["documents"]["max_tokens"] == 100
    assert written[variants[1].policy][1]["rerank"] == {"top_k": 5}  # the rest of the base policy is kept


def test_invalid_field_or_value_is_named(tmp_path):
    (tmp_path / "rag-test.yaml").write_text(yaml.safe_dump(BASE))
    with pytest.raises(ValueError, match="documents.max_tokenz"):
        build_sweep_variants(parse_sweep("documents.max_tokenz=1"), "rag-test", tmp_path, tmp_path / "out")
    with pytest.raises(ValueError, match="cannot exceed"):
        build_sweep_variants(
            parse_sweep("documents.max_tokens=5000"), "rag-test", tmp_path, tmp_path / "out2"
        )
    with pytest.raises(ValueError, match="not found"):
        build_sweep_variants(parse_sweep("documents.max_tokens=1"), "nope", tmp_path, tmp_path / "out3")


def test_remote_sweep_uses_request_overrides():
    variants = build_sweep_variants(parse_sweep("documents.max_tokens=100,200"), "rag-default", None, None)
    assert [variant.overrides for variant in variants] == [
        {"documents.max_tokens": 100},
        {"documents.max_tokens": 200},
    ]
    assert {variant.policy for variant in variants} == {"rag-default"}
