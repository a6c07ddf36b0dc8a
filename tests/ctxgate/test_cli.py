"""The `ctxgate` command line's argument handling: help, unknown commands, bad values.

Usage errors are argparse's: exit status 2 and a message on stderr naming the argument. Values
argparse cannot judge are rejected by the command itself, which `main` turns into
`ctxgate: error: ...` and status 2, never a traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ctxgate.cli import main

REPO = Path(__file__).resolve().parents[2]
EVERY_COMMAND = ("model", "engine", "serve", "policy", "keys", "index", "eval", "bench")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run `ctxgate ARGV` in-process; returns (exit status, stdout, stderr)."""
    try:
        status = main(list(argv))
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_help_lists_every_packages_commands(capsys):
    status, out, _ = run_cli(capsys, "--help")
    assert status == 0
    assert all(command in out for command in EVERY_COMMAND)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["engine", "serve"], "--max-num-seqs"),
        (["serve"], "--upstreams"),
        (["index", "build"], "--chunk-words"),
        (["eval", "gate"], "--max-accuracy-drop"),
        (["bench", "engine"], "--workloads"),
        (["keys", "add"], "tenant"),
    ],
)
def test_each_command_has_help(capsys, argv, flag):
    status, out, _ = run_cli(capsys, *argv, "--help")
    assert status == 0 and flag in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["engine"], "the following arguments are required: engine_command"),
        (["engine", "start"], "invalid choice: 'start'"),
        (["index", "build", "--name", "n"], "the following arguments are required: --input"),
        (["engine", "serve", "--port", "eighty"], "argument --port: invalid int value: 'eighty'"),
        (["engine", "serve", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        (
            ["serve", "--queue-timeout-s", "soon"],
            "argument --queue-timeout-s/--queue-timeout: invalid float value",
        ),
        # Constraints are the settings fields' own, checked while parsing.
        (["engine", "serve", "--port", "0"], "argument --port: Input should be greater than or equal to 1"),
        (
            ["engine", "serve", "--block-size", "-1"],
            "argument --block-size: Input should be greater than or equal",
        ),
        (["serve", "--device", "tpu"], "argument --device: device must be auto, cpu or cuda, not 'tpu'"),
        (
            ["engine", "serve", "--num-kv-blocks", "4", "--kv-cache-memory-mb", "8"],
            "not allowed with argument",
        ),
        (["engine", "serve", "--turbo"], "unrecognized arguments: --turbo"),
        (["--log-level", "loud", "policy", "schema"], "argument --log-level: invalid choice: 'LOUD'"),
    ],
)
def test_usage_errors_exit_2_with_the_reason(capsys, argv, message):
    status, out, err = run_cli(capsys, *argv)
    assert status == 2
    assert message in err and "usage: ctxgate" in err
    assert out == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # --model points nowhere, so a missing check fails on the model instead of serving.
        (
            ["engine", "serve", "--model", "/nonexistent", "--weight-quant", "int4", "--dtype", "float16"],
            "engine: weight_quant int4 runs with bfloat16 activations",
        ),
        (
            ["index", "build", "--input", "/nonexistent.jsonl", "--name", "n", "--chunk-words", "3"],
            "--chunk-words must be at least 8",
        ),
        (
            ["eval", "gate", "--baseline", "/nonexistent/old.json", "--current", "/nonexistent/new.json"],
            "report not found",
        ),
    ],
)
def test_values_a_command_rejects_give_a_one_line_error(capsys, argv, message):
    status, _, err = run_cli(capsys, *argv)
    assert status == 2
    assert err.startswith("ctxgate: error: ") and message in err
    assert "Traceback" not in err


def test_log_level_is_case_insensitive(capsys):
    status, out, _ = run_cli(capsys, "--log-level", "warning", "policy", "schema")
    assert status == 0 and '"properties"' in out


def test_the_parser_is_import_light():
    # `ctxgate --help` must stay instant: building the parser may not import the heavy stacks.
    heavy = ("torch", "transformers", "faiss", "fastapi", "sentence_transformers")
    probe = (
        "import sys; from ctxgate.cli import build_parser; build_parser(); "
        f"print([name for name in {heavy!r} if name in sys.modules])"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_module_entry_point_returns_the_exit_status():
    result = subprocess.run(
        [sys.executable, "-m", "ctxgate", "frobnicate"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.returncode == 2 and "invalid choice: 'frobnicate'" in result.stderr
