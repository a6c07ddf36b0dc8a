"""`ctxgate keys add` has a flag for every limit a key's entry in the keys file holds, and the
tenant's weight; a number that is no limit (inf, nan, zero, negative) is refused naming its flag,
before the file is touched. The file refuses a hand-written infinite budget too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ctxgate.gateway.keys import KeyStore, hash_key, read_keys_file

REPO = Path(__file__).resolve().parents[2]


def _ctxgate(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ctxgate", *argv], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_every_limit_flag_and_the_weight_land_in_the_keys_file(tmp_path):
    keys = tmp_path / "keys.yaml"
    added = _ctxgate(
        "keys", "add", "acme", "--keys-file", str(keys),
        "--weight", "2.5",
        "--time-zone", "Europe/Berlin",
        "--window", "fixed",
        "--requests-per-minute", "60",
        "--tokens-per-minute", "5000",
        "--tokens-per-day", "100000",
        "--tokens-per-week", "400000",
        "--tokens-per-month", "1500000",
        "--spend-per-day", "2.5",
        "--max-parallel-requests", "4",
        "--budget", "20",
        "--budget-period", "weekly",
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    entry = read_keys_file(keys).tenants["acme"]
    assert entry.weight == 2.5
    assert entry.keys[0].sha256 == hash_key(key)
    assert entry.keys[0].limits.model_dump(exclude_none=True) == {
        "requests_per_minute": 60,
        "tokens_per_minute": 5000,
        "tokens_per_day": 100000,
        "tokens_per_week": 400000,
        "tokens_per_month": 1500000,
        "spend_per_day": 2.5,
        "max_parallel_requests": 4,
        "budget": 20.0,
        "budget_period": "weekly",
        "window": "fixed",
        "time_zone": "Europe/Berlin",
    }
    assert KeyStore(keys).resolve(key).weight == 2.5  # what fair queuing and admission read

    # A later key of the same tenant without --weight leaves the tenant's weight as it is.
    assert _ctxgate("keys", "add", "acme", "--keys-file", str(keys)).returncode == 0
    assert read_keys_file(keys).tenants["acme"].weight == 2.5


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--budget", "inf", "argument --budget: 'inf' is not a finite number above 0"),
        ("--budget", "nan", "argument --budget: 'nan' is not a finite number above 0"),
        ("--budget", "-1", "argument --budget: '-1' is not a finite number above 0"),
        ("--spend-per-day", "1e400", "argument --spend-per-day: '1e400' is not a finite number"),
        ("--tokens-per-week", "0", "argument --tokens-per-week: '0' is not a whole number from 1"),
        ("--tokens-per-month", "1.5", "argument --tokens-per-month: '1.5' is not a whole number"),
        ("--weight", "0", "argument --weight: '0' is not a weight"),
        ("--weight", "inf", "argument --weight: 'inf' is not a weight"),
        ("--weight", "1001", "argument --weight: '1001' is not a weight"),
        ("--time-zone", "Mars/Base", "argument --time-zone: unknown time zone 'Mars/Base'"),
    ],
)
def test_a_number_that_is_no_limit_is_refused_naming_its_flag(tmp_path, flag, value, message):
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants: {}\n")
    result = _ctxgate("keys", "add", "acme", "--keys-file", str(keys), flag, value)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert keys.read_text() == "tenants: {}\n"


@pytest.mark.parametrize("field", ["budget", "spend_per_day"])
def test_the_keys_file_refuses_an_infinite_spend_limit(tmp_path, field):
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"tenants:\n  acme:\n    keys:\n      - sha256: {hash_key('k1')}\n        limits: {{{field}: .inf}}\n"
    )
    with pytest.raises(ValueError, match=rf"tenants\.acme\.keys\.0\.limits\.{field}"):
        KeyStore(keys)
