"""The eval extra: a plain install runs `ctxgate --help` and serves without it; the commands that
need it name the install line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ctxgate.eval.cli import EVAL_EXTRA_HINT, require_eval_extra

# Runs with the eval packages made unimportable, as in an install without the extra.
WITHOUT_EXTRA = """
import sys
for name in ("matplotlib", "openai", "pysbd", "langchain_core", "langchain_openai"):
    sys.modules[name] = None
from ctxgate.cli import build_parser, main
import ctxgate.gateway.app, ctxgate.backend.serving.server, ctxgate.compression.pipeline  # the serving path imports without them
build_parser().parse_args(["serve", "--port", "1"])
sys.exit(main(sys.argv[1:]))
"""


def _without_extra(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRA, *argv], capture_output=True, text=True, timeout=120
    )


def test_help_and_the_serving_path_need_no_eval_packages():
    done = _without_extra("--help")
    assert done.returncode == 0, done.stderr
    assert "eval" in done.stdout and "serve" in done.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "retention", "--input", "x.jsonl", "--policy", "rag-default"],
        # `bench e2e` is not here: it needs none of the extra (without matplotlib it skips its plot),
        # since the offline GPU check runs it on a machine that has no eval packages.
        ["eval", "message-context", "--limit", "1"],
    ],
)
def test_a_command_that_needs_the_extra_says_how_to_install_it(argv):
    done = _without_extra(*argv)
    assert done.returncode == 2
    assert EVAL_EXTRA_HINT in done.stderr and "Traceback" not in done.stderr


def test_require_eval_extra_passes_when_installed():
    require_eval_extra("eval run", "json")
    with pytest.raises(ValueError, match="no_such_package_here"):
        require_eval_extra("eval run", "no_such_package_here")
