"""`ctxgate eval shadow-replay`: a shadow log as the gateway writes it, scored again offline with the
gateway's comparison, and a candidate policy's answers against the logged shadow answers."""

from __future__ import annotations

import json

from ctxgate.cli import main
from ctxgate.gateway.shadow.ledger import ShadowRecord
from ctxgate.gateway.shadow.log import log_line, prompt_hash


def _line(request_id: str, policy: str, live: str, shadow: str) -> str:
    record = ShadowRecord(
        request_id=request_id,
        tenant="acme",
        policy=policy,
        model="m",
        comparison="token_f1",
        agreement=0.0,
        measures={},
        prompt_tokens_live=10,
        prompt_tokens_shadow=40,
        completion_tokens_live=2,
        completion_tokens_shadow=2,
        live_answer=live[:300],
        shadow_answer=shadow[:300],
        at=0.0,
    )
    return log_line(record, live, shadow, {"live": prompt_hash("a"), "shadow": prompt_hash("b")})


def test_replay_scores_the_log_and_a_candidate(tmp_path, capsys):
    log = tmp_path / "shadow.jsonl"
    log.write_text(
        _line("r1", "rag-default", "Ida Holm", "Ida Holm")
        + _line("r2", "rag-default", "Paris", "Mara Quist")
        + _line("r3", "rag-fast", '{"a": 1, "b": 2}', '{"a": 1, "b": 3}')
        + "not json\n"
    )
    candidate = tmp_path / "candidate.jsonl"
    candidate.write_text(json.dumps({"request_id": "r2", "answer": "Mara Quist"}) + "\n")
    out = tmp_path / "report.json"
    assert main(["eval", "shadow-replay", str(log), "--candidate", str(candidate), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["skipped"] == 1
    by_policy = {item["policy"]: item for item in report["policies"]}
    assert by_policy["rag-default"]["comparisons"] == 2
    assert by_policy["rag-default"]["mean_agreement"] == 0.5  # token F1: 1 and 0
    assert by_policy["rag-default"]["candidate_mean_agreement"] == 1.0  # the candidate gets r2 right
    assert by_policy["rag-fast"]["mean_agreement"] == 0.5  # auto: JSON field by field
    assert "rag-default: 2 compared, mean agreement 0.500" in capsys.readouterr().out
    main(["eval", "shadow-replay", str(log), "--comparison", "exact", "--out", str(out)])
    assert {item["policy"]: item["mean_agreement"] for item in json.loads(out.read_text())["policies"]} == {
        "rag-default": 0.5,
        "rag-fast": 0.0,
    }
