"""The command line is consistent: every flag of every subcommand has help text, `--version` works,
`--log-level` is accepted after any subcommand, and the old flag spellings still work (with a
deprecation notice) while the help shows one name per concept."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ctxgate.cli import build_parser, parse_args

REPO = Path(__file__).resolve().parents[1]


def _parsers(parser: argparse.ArgumentParser, path: str = "ctxgate"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_argument_of_every_subcommand_has_help():
    missing = []
    leaves = 0
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
        leaves += not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
    assert leaves >= 15
    assert not missing, "arguments without help text:\n" + "\n".join(missing)


def test_version_and_log_level_anywhere():
    result = subprocess.run(
        [sys.executable, "-m", "ctxgate", "--version"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == "ctxgate 0.1.0"
    assert parse_args(["policy", "schema", "--log-level", "debug"]).log_level == "DEBUG"
    assert parse_args(["--log-level", "warning", "policy", "schema"]).log_level == "WARNING"
    assert parse_args(["policy", "schema"]).log_level == "INFO"
    with pytest.raises(SystemExit):
        parse_args(["policy", "schema", "--log-level", "loud"])


def test_one_name_per_concept_with_deprecated_aliases(capsys):
    bench = parse_args(["bench", "engine", "--url", "http://x", "--model-name", "m", "--api-key", "k"])
    assert bench.served_model_name == "m" and bench.api_key == "k"
    assert "--model-name is deprecated; use --served-model-name" in capsys.readouterr().err
    evaluation = parse_args(["eval", "run", "--dataset", "d.jsonl", "--policy", "p", "--out", "o"])
    assert evaluation.dataset == "d.jsonl"
    assert "--dataset is deprecated; use --input" in capsys.readouterr().err
    assert (
        parse_args(["eval", "run", "--input", "d.jsonl", "--policy", "p", "--out", "o"]).dataset == "d.jsonl"
    )
    assert capsys.readouterr().err == ""
    serve = parse_args(["serve", "--upstream-model", "m"])
    assert serve.upstream_model == "m"
    assert "--upstream-model is deprecated; use --served-model-name" in capsys.readouterr().err
    # The help lists the deprecated spellings as such, next to the one name to use.
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            for old in ("--model-name", "--dataset", "--upstream-model"):
                if old in action.option_strings:
                    assert "deprecated" in action.help, f"{path} {old}"
