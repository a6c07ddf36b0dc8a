"""Every fenced block of README.md and docs/quickstart.md, run as printed against one real `ctxgate serve`
(the port substituted): the shell and Python blocks run, and their output has the shape of the output
block the doc shows after them (the JSON keys, the dict keys of a printed dict, the numbers' places in a
line). A block that cannot run here (make targets, installs) is listed with the reason; a new block
that is in no list fails, so the front door cannot rot unseen."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.servers import ctxgate_env, ctxgate_process, free_port, wait_http

REPO = Path(__file__).resolve().parents[2]
DOC_URL = "http://127.0.0.1:8000"
FIRST_REQUEST = REPO / "examples" / "first_request.json"


@dataclass(frozen=True)
class Block:
    doc: str
    index: int
    lang: str
    code: str


@dataclass(frozen=True)
class Run:
    marker: str  # a string found in exactly one block of the doc
    shows_output: bool  # the doc's next block is this one's output


@dataclass(frozen=True)
class Skip:
    marker: str
    reason: str


PLANS: dict[str, list[Run | Skip]] = {
    "README.md": [
        Skip("make serve", "starts the server this test starts itself; `make test` is the suite"),
        Run("-d @examples/first_request.json", shows_output=True),
        Run("from openai import OpenAI", shows_output=True),
        Run("from langchain_openai import ChatOpenAI", shows_output=True),
    ],
    "docs/quickstart.md": [
        Skip("make serve", "starts the server this test starts itself; `make test` is the suite"),
        Skip(
            "pip install .",
            "installs into the environment (tests/gateway/test_wheel_install.py builds the wheel)",
        ),
        Skip("apt-get install", "system packages, needs root"),
        Run("/v1/chat/completions", shows_output=True),
        Run("/v1/ctxgate/compress", shows_output=False),
        Run("from openai import OpenAI", shows_output=True),
        Run("from langchain_openai import ChatOpenAI", shows_output=True),
    ],
}
RUNNABLE = {"bash", "sh", "python"}


def blocks(doc: str) -> list[Block]:
    text = (REPO / doc).read_text()
    return [
        Block(doc, index, match.group(1), match.group(2))
        for index, match in enumerate(re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S))
    ]


def planned(doc: str) -> Iterator[tuple[Run | Skip, Block, Block | None]]:
    """Each plan entry with its block (and the output block it shows), in the doc's order; raises
    when a marker is not in exactly one block or a block is in no plan."""
    found = blocks(doc)
    claimed: dict[int, str] = {}
    entries = []
    for entry in PLANS[doc]:
        matches = [block for block in found if entry.marker in block.code and block.lang in RUNNABLE]
        assert len(matches) == 1, f"{doc}: {entry.marker!r} is in {len(matches)} blocks"
        block = matches[0]
        claimed[block.index] = entry.marker
        output = None
        if isinstance(entry, Run) and entry.shows_output:
            output = found[block.index + 1]
            assert output.lang in {"json", "text"}, f"{doc}: the block after {entry.marker!r} is not output"
            claimed[output.index] = f"output of {entry.marker!r}"
        entries.append((entry, block, output))
    unplanned = [block.code.splitlines()[0] for block in found if block.index not in claimed]
    assert unplanned == [], f"{doc}: blocks in no plan (add them to PLANS, run or skipped with a reason)"
    return iter(entries)


def run_block(block: Block, url: str) -> str:
    code = block.code.replace(DOC_URL, url)
    command = (
        [sys.executable, "-c", code] if block.lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    )
    # python3 in a shell block is the one running the tests (a venv's, with the doc's imports).
    env = ctxgate_env(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{block.doc} block {block.index}:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.strip(), f"{block.doc} block {block.index} printed nothing"
    return result.stdout


def key_paths(value: object, prefix: str = "") -> set[str]:
    if isinstance(value, dict):
        paths = set()
        for key, child in value.items():
            paths |= {f"{prefix}{key}"} | key_paths(child, f"{prefix}{key}.")
        return paths
    if isinstance(value, list) and value:
        return key_paths(value[0], f"{prefix}[].")
    return set()


def _literal(line: str) -> object:
    try:
        return ast.literal_eval(line)
    except (ValueError, SyntaxError):
        return None


def _number_mask(line: str) -> str:
    return re.sub(r"\d+(?:[.,]\d+)*", "N", line)


def assert_same_shape(shown: Block, printed: str) -> None:
    if shown.lang == "json":
        missing = key_paths(json.loads(shown.code)) - key_paths(json.loads(printed))
        assert missing == set(), f"{shown.doc}: keys the doc shows that the output lacks"
        return
    shown_lines, printed_lines = shown.code.strip().splitlines(), printed.strip().splitlines()
    assert len(printed_lines) == len(shown_lines), printed
    for want, got in zip(shown_lines, printed_lines, strict=True):
        expected = _literal(want)
        if isinstance(expected, dict):
            actual = _literal(got)
            assert isinstance(actual, dict) and set(expected) <= set(actual), (want, got)
        elif re.search(r"\d", want):
            assert _number_mask(got) == _number_mask(want), (want, got)
        else:
            assert got.strip(), (want, got)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[str]:
    """`ctxgate serve` as `make serve` runs it (defaults, no keys file), on a free port."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with ctxgate_process(["serve", "--port", str(port)], log):
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/ready", timeout_s=240)
        yield url


@pytest.mark.parametrize("doc", sorted(PLANS))
def test_every_block_is_run_or_skipped_with_a_reason(doc):
    entries = list(planned(doc))
    assert any(isinstance(entry, Run) for entry, _, _ in entries)
    assert all(entry.reason for entry, _, _ in entries if isinstance(entry, Skip))


@pytest.mark.parametrize("doc", sorted(PLANS))
def test_the_blocks_run_as_printed(doc, gateway):
    if shutil.which("curl") is None:
        pytest.skip("the docs' shell blocks use curl, which is not on PATH")
    ran = 0
    for entry, block, output in planned(doc):
        if isinstance(entry, Skip):
            continue
        printed = run_block(block, gateway)
        ran += 1
        if output is not None:
            assert_same_shape(output, printed)
    assert ran >= 3


def test_the_first_request_shows_compression_and_one_answer(gateway):
    """The README's acceptance: >= 3x fewer prompt tokens and the same answer on two runs."""
    if shutil.which("curl") is None:
        pytest.skip("the README's first request is a curl command")
    block = next(block for entry, block, _ in planned("README.md") if entry.marker.startswith("-d @"))
    replies = [json.loads(run_block(block, gateway)) for _ in range(2)]
    answers = {reply["choices"][0]["message"]["content"] for reply in replies}
    assert len(answers) == 1
    assert "Louvre" in answers.pop()
    report = replies[0]["usage"]["ctxgate"]
    assert report["original_prompt_tokens"] >= 3 * report["prompt_tokens"]
    shown = json.loads(blocks("README.md")[block.index + 1].code)["usage"]["ctxgate"]
    # The token counts the README prints are the program's (tokenizer and compression are deterministic).
    assert (report["original_prompt_tokens"], report["prompt_tokens"]) == (
        shown["original_prompt_tokens"],
        shown["prompt_tokens"],
    )


def test_the_langchain_example_finds_its_passages_in_the_messages(gateway):
    printed = subprocess.run(
        [sys.executable, "examples/langchain_rag.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=ctxgate_env(CTXGATE_URL=f"{gateway}/v1"),
        check=True,
    ).stdout
    found = _literal(re.search(r"found in the messages: (\{.*\})", printed).group(1))
    assert found["passages_found"] == 6 and found["tokens_cut"] > 0
