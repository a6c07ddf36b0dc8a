import json
import subprocess
import sys

import numpy as np
import pytest

from ctxgate.compression.store.index import IndexStore, UnknownIndexError, build_index, chunk_sentences
from ctxgate.compression.types import CompressionInput, RetrievalSpec
from ctxgate.policies.schema import Policy

CORPUS = [
    {
        "id": "volcano",
        "title": "Mount Etna",
        "text": "Mount Etna is an active stratovolcano on the east coast of Sicily. It is one of the tallest active volcanoes in Europe.",
    },
    {
        "id": "bread",
        "title": "Sourdough",
        "text": "Sourdough bread is made by fermenting dough with wild yeast and lactobacilli. The starter must be fed regularly.",
    },
    {
        "id": "chess",
        "title": "Chess",
        "text": "Chess is a board game for two players. Each player begins with sixteen pieces, including one king.",
    },
    {
        "id": "moon",
        "title": "Apollo 11",
        "text": "Apollo 11 landed the first humans on the Moon in July 1969. Neil Armstrong stepped out first.",
    },
]


def write_corpus(path):
    path.write_text("\n".join(json.dumps(row) for row in CORPUS) + "\n")


def test_chunking_keeps_sentences_whole():
    chunks = chunk_sentences(["one two three.", "four five.", "six seven eight nine."], max_words=5)
    assert chunks == [["one two three.", "four five."], ["six seven eight nine."]]


def test_cli_builds_an_index_with_sentence_embeddings(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    write_corpus(corpus)
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "ctxgate",
            "index",
            "build",
            "--input",
            str(corpus),
            "--name",
            "demo",
            "--index-dir",
            str(tmp_path / "idx"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    target = tmp_path / "idx" / "demo"
    meta = json.loads((target / "meta.json").read_text())
    assert meta["chunks"] == 4 and meta["sentences"] == 8
    assert np.load(target / "sentence_embeddings.npy").shape == (8, meta["dimension"])
    assert "embedding demo" in completed.stderr  # the tqdm progress bar


def test_bad_input_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "no text"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        build_index(bad, "bad", tmp_path)
    with pytest.raises(ValueError, match="invalid index name"):
        build_index(bad, "../escape", tmp_path)


async def test_retrieval_round_trip(tmp_path, embedder, make_pipeline):
    corpus = tmp_path / "docs.jsonl"
    write_corpus(corpus)
    build_index(corpus, "demo", tmp_path, embedder=embedder, show_progress=False)
    loaded = IndexStore(tmp_path).get("demo")
    hits = loaded.search(embedder.embed(["Which volcano is in Sicily?"])[0], top_n=2)
    assert loaded.chunks[hits[0][0]]["doc_id"] == "volcano"

    pipeline = make_pipeline(index_dir=tmp_path)
    policy = Policy(name="rag", max_input_tokens=512, documents={"max_tokens": 200})
    request = CompressionInput(
        messages=[{"role": "user", "content": "Who was the first person to walk on the Moon?"}],
        retrieval=RetrievalSpec(index="demo", top_n=2),
    )
    result = await pipeline.run(request, policy)
    assert "Neil Armstrong stepped out first." in result.context_text
    assert result.kept_documents[0].id == "moon#0"
    assert [s.name for s in result.stages] == [
        "retrieval",
        "cost-check",
        "history",
        "dedup",
        "rerank",
        "extraction",
        "assembly",
        "fit",
    ]
    retrieval = result.stages[0]
    assert retrieval.details["retrieved"] == 2

    with pytest.raises(UnknownIndexError):
        await pipeline.run(
            CompressionInput(
                messages=[{"role": "user", "content": "q"}], retrieval=RetrievalSpec(index="nope")
            ),
            policy,
        )
