"""`ctxgate eval fit-curve`: retention under fitting, a point per prompt budget from the policy's
normal one to its floor, each budget applied as the gateway applies a fit."""

from __future__ import annotations

import subprocess
import sys

from ctxgate.eval.fit_curve import curve_table, fit_budgets, fitted_policy, run_fit_curve
from ctxgate.policies.schema import Policy
from tests.eval.test_retention import _tiny_dataset
from tests.support.servers import write_policy


def test_budgets_fall_geometrically_from_the_normal_budget_to_the_floor():
    policy = Policy(name="p", max_input_tokens=2_048, fit={"min_context_tokens": 256})
    assert fit_budgets(policy, 4) == [2_048, 1_024, 512, 256]
    assert fit_budgets(policy, 1) == [2_048]
    small = Policy(
        name="q", max_input_tokens=200, documents={"max_tokens": 100}, fit={"min_context_tokens": 256}
    )
    assert fit_budgets(small, 4) == [200]


def test_a_fitted_budget_caps_the_prompt_and_the_documents():
    policy = Policy(name="p", max_input_tokens=2_048, documents={"max_tokens": 560})
    fitted = fitted_policy(policy, 300)
    assert (fitted.max_input_tokens, fitted.documents.max_tokens) == (300, 300)
    assert fitted_policy(policy, 1_024).documents.max_tokens == 560


def test_retention_falls_and_a_budget_under_the_pinned_parts_is_refused(tmp_path):
    dataset = str(_tiny_dataset(tmp_path))
    write_policy(
        tmp_path,
        "fitp",
        "name: fitp\nmax_input_tokens: 600\ndocuments: {max_tokens: 560}\nrerank: {method: bm25}\n"
        "dedup: {near_duplicate_cosine: null}\nfit: {min_context_tokens: 40}\n",
    )
    report = run_fit_curve([dataset], "fitp", limit=3, policy_dir=str(tmp_path), budgets=[600, 120, 40])
    points = report["curves"]["tiny"]
    assert [p["budget"] for p in points] == [600, 120, 40]
    assert points[0]["answer_retention"] == 1.0 and points[0]["refused"] == 0
    assert points[1]["prompt_tokens_mean"] <= 120 < points[0]["prompt_tokens_mean"]
    # 40 tokens cannot hold the system prompt and a question: refused, as the gateway would refuse it.
    assert points[2]["refused"] == 3 and points[2]["answer_retention"] is None
    table = curve_table(report)
    assert table[0].startswith("| dataset | prompt budget") and len(table) == 2 + 3


def test_the_cli_prints_the_curve(tmp_path):
    dataset = str(_tiny_dataset(tmp_path))
    out = tmp_path / "curve.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ctxgate",
            "eval",
            "fit-curve",
            "--input",
            dataset,
            "--policy",
            "passthrough",
            "--budgets",
            "2048,256",
            "--limit",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "| tiny | 2048 |" in done.stdout and "| tiny | 256 |" in done.stdout
    assert out.exists()
