"""The hostile soak, short: one tenant sends the whole hostile mix (tests/reliability/hostile_mix.py) at
full speed against a real `ctxgate serve` while another streams normal chat requests; every one of the
victim's requests must complete. `make soak-hostile` is the 10-minute version with the TTFT and RSS
acceptance checks too (too noisy to assert in 30 s on a shared CI machine).

Run it alone: `pytest -m slow tests/security/test_hostile_soak.py -s` (report and server log in the
test's temporary folder, printed on failure)."""

from __future__ import annotations

import json

import pytest

from tests.reliability.hostile_mix import hostile_mix
from tests.reliability.hostile_report import markdown, rss_trend
from tests.reliability.hostile_soak import SoakConfig, run_soak


@pytest.fixture(scope="module")
def report(tmp_path_factory, model_dir) -> dict:
    out = tmp_path_factory.mktemp("hostile-soak")
    config = SoakConfig(baseline_s=20, attack_s=30, victim_timeout_s=60, warm_up_requests=2, out=out)
    result = run_soak(config)
    print(markdown(result), f"\n(report and server log in {out})")
    return result


@pytest.mark.slow
def test_the_attack_ran(report):
    """The harness itself: every kind of the mix was sent (answered or not) while the victim was loaded."""
    assert {hostile.kind for hostile in hostile_mix()} <= set(report["attacker"]["by_kind"]), report[
        "attacker"
    ]
    assert report["victim"]["under_attack"]["requests"] > 0


@pytest.mark.slow
def test_the_victim_never_fails_while_another_tenant_attacks(report):
    alone, under_attack = report["victim"]["alone"], report["victim"]["under_attack"]
    # Without an attacker the victim must be served: otherwise this machine is too slow for the test.
    assert alone["errors"] == 0 and alone["completed"] > 0, markdown(report)
    assert under_attack["errors"] == 0, markdown(report)
    assert under_attack["completed"] > 0


@pytest.mark.slow
def test_hostile_requests_get_4xx_never_5xx(report):
    by_kind = report["attacker"]["by_kind"]
    assert report["attacker"]["server_errors"] == [], markdown(report)
    # The spent key is refused (cheaply, so in time), never served nor left waiting.
    spent = by_kind.get("over_quota_chat", {}) | by_kind.get("over_quota_compress", {})
    assert set(spent) == {"429"}, json.dumps(by_kind)


# -- the harness's own parts (fast) ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("mib_at", "levels_off"),
    [
        (lambda t: 2000.0, True),  # flat
        (lambda t: 2000 + 2 * t, False),  # 120 MiB/min, steady: a leak
        (lambda t: 2000 + 4 * min(t, 60), True),  # grows, then holds
        (lambda t: 2000 + (t if t < 60 else 60 + 0.8 * (t - 60)), False),  # barely slows: still growing
    ],
)
def test_rss_levels_off_only_when_the_growth_stops(mib_at, levels_off):
    samples = [(float(t), mib_at(t)) for t in range(0, 240, 2)]
    assert rss_trend(samples, flat_mib_per_min=5.0)["levels_off"] is levels_off


def test_every_hostile_body_is_json_and_documents_are_unique_per_request():
    for hostile in hostile_mix():
        first, second = json.loads(hostile.body(1)), json.loads(hostile.body(2))
        assert first["model"] and "@@" not in json.dumps(first), hostile.kind
        if hostile.document_chars:
            documents = first["ctxgate"]["documents"]
            assert all(len(d["text"]) == hostile.document_chars for d in documents)
            assert len({d["text"] for d in documents}) == len(documents)
            assert {d["text"] for d in documents}.isdisjoint(
                d["text"] for d in second["ctxgate"]["documents"]
            )
