"""`ctxgate eval retention-curve`: the policy's curve over a budget sweep beside a peer's output."""

from __future__ import annotations

import json

from ctxgate.cli import main
from tests.eval.test_retention import _tiny_dataset


def test_curve_scores_the_policy_and_the_peer_on_the_same_questions(tmp_path, capsys):
    dataset = _tiny_dataset(tmp_path)
    name = dataset.stem
    rows = [  # the peer kept the answer for q0, lost it for q1
        {
            "id": "q0",
            "target_ratio": 3.0,
            "compressed_context": "The Eiffel Tower was completed in 1889.",
            "compression_ms": 900.0,
            "compression_cpu_ms": 850.0,
        },
        {
            "id": "q1",
            "target_ratio": 3.0,
            "compressed_context": "Hamlet is a tragedy.",
            "compression_ms": 800.0,
            "compression_cpu_ms": 750.0,
        },
    ]
    peer = tmp_path / "peer.json"
    peer.write_text(json.dumps({"peer": "LongLLMLingua", "datasets": {name: rows}}))
    out = tmp_path / "out"
    code = main(
        [
            "eval",
            "retention-curve",
            "--input",
            str(dataset),
            "--split",
            "all",
            "--limit",
            "3",
            "--budgets",
            "1000,40",
            "--peer",
            str(peer),
            "--out",
            str(out),
        ]
    )
    assert code == 0 and "report:" in capsys.readouterr().out
    report = json.loads((out / "curve.json").read_text())
    assert report["peer_meta"] == {"peer": "LongLLMLingua"} and report["budgets"] == [1000, 40]
    ours, theirs = report["curves"][name]["rag-default"], report["curves"][name]["LongLLMLingua"]
    assert [point["budget"] for point in ours] == [1000, 40]
    assert ours[0]["n_scored"] == 3 and ours[0]["compression_ms_p50"] is not None
    assert ours[1]["compression_ratio"] > ours[0]["compression_ratio"]  # the tighter budget cuts more
    assert ours[1]["compression_ms_p50"] is None  # warm caches: not a first-sight time
    assert len(theirs) == 1 and theirs[0]["answer_retention"] == 0.5 and theirs[0]["compression_ratio"] > 1
    assert (out / "retention_vs_ratio.png").stat().st_size > 0

    # --reuse takes the policy's points from the earlier curve instead of running it again
    again = tmp_path / "again"
    assert (
        main(
            [
                "eval",
                "retention-curve",
                "--input",
                str(dataset),
                "--reuse",
                str(out / "curve.json"),
                "--out",
                str(again),
            ]
        )
        == 0
    )
    assert json.loads((again / "curve.json").read_text())["curves"][name]["rag-default"] == ours


def test_curve_refuses_bad_budgets(tmp_path, capsys):
    assert (
        main(["eval", "retention-curve", "--input", "x.jsonl", "--budgets", "400,-1", "--out", str(tmp_path)])
        == 2
    )
    assert "--budgets" in capsys.readouterr().err
