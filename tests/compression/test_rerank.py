"""Rerankers: default embedding+BM25 fusion, and the CrossEncoder plumbing.

No PyPI package we found ships cross-encoder weights for offline use, so the CrossEncoder test
builds a tiny, randomly initialised BERT cross-encoder (one layer) in tmp_path and checks that the
pipeline loads it from the configured local path and ranks passages by its scores.
"""

from __future__ import annotations

import numpy as np
import pytest

from ctxgate.compression.rerank import BM25Reranker, CrossEncoderReranker, FusedReranker
from ctxgate.compression.state import Passage
from ctxgate.compression.types import CompressionInput, Document
from ctxgate.policies.schema import Policy

PASSAGES = [
    Document(text="Bananas are rich in potassium and grow in tropical climates.", title="Banana"),
    Document(
        text="The Golden Gate Bridge spans the strait at the entrance to San Francisco Bay.",
        title="Golden Gate Bridge",
    ),
    Document(
        text="A suspension bridge hangs its deck from cables strung between towers.",
        title="Suspension bridge",
    ),
    Document(text="Jazz developed in New Orleans in the early twentieth century.", title="Jazz"),
]
QUESTION = "Which bridge crosses the entrance to San Francisco Bay?"


def as_passages(documents):
    return [Passage(document=d, position=i) for i, d in enumerate(documents)]


def test_fused_reranker_puts_the_relevant_passage_first(embedder):
    scores = FusedReranker(embedder, bm25_weight=0.3).score(QUESTION, as_passages(PASSAGES))
    assert int(np.argmax(scores)) == 1
    assert scores.min() >= 0 and scores.max() <= 1


def test_bm25_handles_questions_without_known_words():
    scores = BM25Reranker().score("zzzz qqqq", as_passages(PASSAGES))
    assert scores.tolist() == [0.0] * 4


@pytest.fixture(scope="module")
def tiny_cross_encoder(tmp_path_factory):
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from ctxgate.compression.embedding.embeddings import default_model_path

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path()))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        num_labels=1,
    )
    path = tmp_path_factory.mktemp("tiny-cross-encoder")
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), CrossEncoder(str(path), device="cpu")


async def test_cross_encoder_from_local_path_drives_the_ranking(tiny_cross_encoder, make_pipeline):
    path, reference = tiny_cross_encoder
    reranker = CrossEncoderReranker(path)
    passages = as_passages(PASSAGES)
    scores = reranker.score(QUESTION, passages)
    expected = reference.predict([(QUESTION, f"{p.title}. {p.text}") for p in passages])
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-5)

    policy = Policy(
        name="ce",
        max_input_tokens=512,
        documents={"max_tokens": 300},
        rerank={"method": "cross-encoder", "cross_encoder_path": path, "top_k": 2},
        dedup={"enabled": False},
    )
    result = await make_pipeline().run(
        CompressionInput(messages=[{"role": "user", "content": QUESTION}], documents=PASSAGES), policy
    )
    best_two = {PASSAGES[i].title for i in np.argsort(-scores)[:2]}
    assert {d.title for d in result.kept_documents} == best_two
    assert next(s for s in result.stages if s.name == "rerank").details["method"] == "cross-encoder"


def test_cross_encoder_path_must_exist(tmp_path):
    with pytest.raises(ValueError, match="not a local model directory"):
        CrossEncoderReranker(str(tmp_path / "missing"))


def test_llm_reranker_scores_the_answering_passage_highest(tokenizer):
    from ctxgate.compression.llm_score import LLMReranker

    reranker = LLMReranker.from_tokenizer(tokenizer)
    documents = [
        Document(text="Bananas are rich in potassium and grow in tropical climates.", title="Banana"),
        Document(text="Paris is the capital and largest city of France.", title="Paris"),
        Document(text="Jazz developed in New Orleans in the early twentieth century.", title="Jazz"),
    ]
    scores = LLMReranker.score(reranker, "What is the capital of France?", as_passages(documents))
    assert scores.shape == (3,)
    assert int(np.argmax(scores)) == 1


# Untitled passages (LangChain's default "{page_content}" document prompt drops the title): the
# pre-filter embedded only the first passage's weak sentence, so its vector misses what it is about.
UNTITLED_QUESTION = "Which bridge crosses the entrance to San Francisco Bay?"
UNTITLED = [
    [
        "The deck was closed to traffic for a day in 1987.",
        "The Golden Gate Bridge is a suspension bridge spanning the strait at the entrance to San Francisco Bay.",
        "It links the city of San Francisco to Marin County.",
    ],
    ["Ferries cross San Francisco Bay every day from the Ferry Building."],
    ["The entrance to the harbour is guarded by a lighthouse."],
    ["Sea lions crowd the piers of the waterfront."],
]


def _untitled_state(tokenizer, embedder, titled: bool):
    from ctxgate.compression.pipeline import CompressionPipeline
    from ctxgate.compression.stages.base import StageContext
    from ctxgate.compression.state import split_messages

    documents = [
        Document(text=" ".join(sentences), title=f"Title {i}" if titled else None)
        for i, sentences in enumerate(UNTITLED)
    ]
    policy = Policy(name="p", rerank={"method": "embedding-bm25", "top_k": 1})
    pipeline = CompressionPipeline(tokenizer)
    pipeline.services._embedder = embedder
    state = split_messages(
        CompressionInput(messages=[{"role": "user", "content": UNTITLED_QUESTION}], documents=documents),
        budget_tokens=policy.max_input_tokens,
    )
    state.prefiltered = True  # the pre-filter's choice, set by hand below
    for passage, sentences in zip(state.passages, UNTITLED, strict=True):
        passage.sentences = list(sentences)
    state.passages[0].embed_sentences = {0}
    return state, StageContext(policy=policy, counter=pipeline.counter, services=pipeline.services)


async def test_untitled_passage_whose_topic_sentences_were_not_embedded_survives_the_cut(tokenizer, embedder):
    from ctxgate.compression.stages.rerank import RerankStage

    state, ctx = _untitled_state(tokenizer, embedder, titled=False)
    first_stage = FusedReranker(embedder, 0.3).score(UNTITLED_QUESTION, state.passages)
    assert int(np.argmax(first_stage)) != 0  # on its pre-filtered sentence alone it loses the cut
    await RerankStage().run(state, ctx)
    assert [p.position for p in state.passages] == [0]
    assert state.passages[0].embed_sentences is None  # extraction scores all its sentences too


def test_second_stage_leaves_titled_passages_as_scored(tokenizer, embedder):
    from ctxgate.compression.rerank import refine_untitled

    state, _ = _untitled_state(tokenizer, embedder, titled=True)
    reranker = FusedReranker(embedder, 0.3)
    scores = reranker.score(UNTITLED_QUESTION, state.passages)
    assert refine_untitled(reranker, UNTITLED_QUESTION, state.passages, scores, keep=1) is scores
    assert state.passages[0].embed_sentences == {0}


def test_second_stage_ranks_candidates_above_the_rest(embedder):
    from ctxgate.compression.rerank import refine_untitled

    passages = as_passages([Document(text=" ".join(s)) for s in UNTITLED])
    for passage, sentences in zip(passages, UNTITLED, strict=True):
        passage.sentences = list(sentences)
    reranker = FusedReranker(embedder, 0.3)
    first = reranker.score(UNTITLED_QUESTION, passages)
    refined = refine_untitled(reranker, UNTITLED_QUESTION, passages, first, keep=1)
    candidates = set(np.argsort(-first, kind="stable")[:2].tolist())
    others = [i for i in range(len(passages)) if i not in candidates]
    assert min(refined[list(candidates)]) > max(refined[others])
    # On the first stage's scale: the candidates over the range they had, the rest unchanged.
    assert min(refined[list(candidates)]) == pytest.approx(min(first[list(candidates)]))
    assert max(refined[list(candidates)]) == pytest.approx(max(first[list(candidates)]))
    assert refined[others].tolist() == pytest.approx(first[others].tolist())
    # The rest keep their first-stage order.
    assert np.argsort(-refined[others]).tolist() == np.argsort(-first[others]).tolist()


def test_bm25_scores_equal_bm25s_own_scoring():
    import bm25s

    from ctxgate.compression.rerank import bm25_scores

    documents = [
        "Paris is the capital and most populous city of France.",
        "The Eiffel Tower in Paris was completed in 1889; Paris hosted the fair.",
        "",
        "Photosynthesis converts light energy into chemical energy in plants.",
        "France borders Spain, and Paris is far from the border.",
    ]
    query = "What is the capital of France, Paris or Paris?"  # a repeated term counts twice
    corpus = [
        terms or ["\u2205"]
        for terms in bm25s.tokenize(documents, stopwords="en", return_ids=False, show_progress=False)
    ]
    retriever = bm25s.BM25()
    retriever.index(corpus, show_progress=False)
    query_terms = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
    expected = retriever.get_scores([term for term in query_terms if term in retriever.vocab_dict])
    np.testing.assert_allclose(bm25_scores(query, documents), expected, rtol=1e-5, atol=1e-6)
    assert not bm25_scores("nothing matches zzz", documents).any()
    assert bm25_scores(query, []).shape == (0,)
