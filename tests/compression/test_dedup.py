import numpy as np

from ctxgate.compression.dedup import duplicate_indices
from ctxgate.compression.types import CompressionInput, Document
from ctxgate.policies.schema import Policy

BASE = "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France."


def test_exact_duplicates_ignore_case_spacing_and_punctuation():
    texts = [
        BASE,
        "the eiffel tower is a wrought iron lattice tower  on the Champ de Mars in Paris France",
        "Cats purr.",
    ]
    assert duplicate_indices(texts, exact=True) == {1}


def test_near_duplicates_by_embedding_cosine(embedder):
    texts = [
        BASE,
        "The Eiffel Tower is a wrought-iron lattice tower located on the Champ de Mars in Paris, France.",
        "Photosynthesis converts light energy into chemical energy in plants.",
    ]
    vectors = embedder.embed(texts)
    assert float(vectors[0] @ vectors[1]) > 0.92
    assert duplicate_indices(texts, vectors, exact=True, near_cosine=0.92) == {1}
    assert duplicate_indices(texts, vectors, exact=True, near_cosine=None) == set()


def test_higher_priority_copy_survives():
    texts = ["Same text here.", "same text here"]
    assert duplicate_indices(texts, exact=True, priority=[0.1, 0.9]) == {0}


def test_empty_vectors_are_fine():
    assert duplicate_indices([], np.zeros((0, 4)), near_cosine=0.9) == set()


async def test_pipeline_removes_duplicate_passages_and_sentences(make_pipeline, tokenizer):
    pipeline = make_pipeline()
    shared_sentence = "Gustave Eiffel's company designed and built the tower between 1887 and 1889."
    documents = [
        Document(text=f"{BASE} {shared_sentence}", title="Eiffel Tower"),
        Document(
            text=f"{BASE} {shared_sentence}".upper() + "!!", title="Eiffel Tower"
        ),  # exact dup once normalized
        Document(
            text="The Eiffel Tower is a wrought-iron lattice tower located on the Champ de Mars in Paris, France. "
            + shared_sentence,
            title="Eiffel Tower",
        ),  # near duplicate
        Document(
            text=f"Paris hosted the 1889 World's Fair. {shared_sentence}", title="Exposition Universelle"
        ),
    ]
    policy = Policy(
        name="dedup", max_input_tokens=1024, documents={"max_tokens": 500}, rerank={"enabled": False}
    )
    request = CompressionInput(
        messages=[{"role": "user", "content": "Who built the Eiffel Tower?"}], documents=documents
    )
    result = await pipeline.run(request, policy)
    dedup = next(stage for stage in result.stages if stage.name == "dedup")
    assert dedup.details["passages_removed"] == 2
    assert dedup.details["sentences_removed"] == 1
    assert dedup.saved_tokens > 0
    assert result.context_text.count(shared_sentence) == 1
    assert result.context_text.lower().count("champ de mars") == 1
    assert "Paris hosted the 1889 World's Fair." in result.context_text
    assert result.prompt_tokens == tokenizer.count_chat(result.messages)


def test_near_duplicates_stating_different_numbers_are_both_kept():
    # Embedded alike (here: the same vector), yet each states its own fact.
    texts = [
        "It has a Roud Folk Song Index number of 5040.",
        "It has a Roud Folk Song Index number of 821.",
        "It has a Roud Folk Song Index number of 5040 .",
    ]
    vectors = np.tile(np.array([[1.0, 0.0, 0.0, 0.0]], dtype=np.float32), (3, 1))
    assert duplicate_indices(texts, vectors, exact=False, near_cosine=0.92) == {2}
