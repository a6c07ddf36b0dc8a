"""Multi-hop questions (compression/multihop/): how a text names a passage, and the bridge passage a
question needs surviving a tight budget, under the learned scorer's pointer round (rag-default)
and the query-expansion hop (rag-multihop)."""

from __future__ import annotations

import asyncio

import pytest

from ctxgate.compression.multihop.names import mentions, title_core
from ctxgate.compression.types import CompressionInput, Document
from ctxgate.policies.schema import ExtractionPolicy, Policy

BRIDGE_QUESTION = (
    "What government position was held by the woman who portrayed Corliss Archer in the film Kiss and Tell?"
)
KISS = Document(
    title="Kiss and Tell (1945 film)",
    text="Kiss and Tell is a 1945 American comedy film starring then 17-year-old Shirley Temple as Corliss Archer."
    # More than the block budget holds, so the extraction must choose sentences.
    " The film was shot in black and white over six weeks in the spring."
    " It premiered in New York and was a box office success."
    " A sequel, A Kiss for Corliss, followed in 1949.",
)
TEMPLE = Document(
    title="Shirley Temple",
    text="Shirley Temple Black was an American actress. As an adult, she held the government post of Chief of "
    "Protocol of the United States.",
)


@pytest.mark.parametrize(
    ("text", "title", "named"),
    [
        ('the adventure in "Tunnels and Trolls", a game', "Tunnels &amp; Trolls", True),
        ("The author of The Thing of It Is... is what nationality?", "The Thing of It Is...", True),
        ("the first to cultivate cranberries in bogs", "Cranberry", True),
        ("He was born in Boston.", "Boston, Lincolnshire", True),
        ("Bostonians call it the Hub.", "Boston, Lincolnshire", False),
        ("He was kissing the bride.", "Kiss and Tell (1945 film)", False),
    ],
)
def test_a_title_is_named_across_entities_ampersands_punctuation_and_plurals(text, title, named):
    assert mentions(text, title_core(title)) is named


def test_a_title_is_named_with_or_without_its_apostrophes():
    assert mentions("What year did Guns N Roses perform a promo?", title_core("Guns N' Roses"))
    assert mentions("opposite St James Palace", title_core("St James's Palace"))


def test_rag_default_follows_hops_with_its_learned_scorer_and_rag_adaptive_extracts_alike():
    from ctxgate.policies.loader import load_policy_file, packaged_policy_dir

    default = load_policy_file(packaged_policy_dir() / "rag-default.yaml")
    assert default.extraction.scorer == "learned" and default.rerank.top_k is None
    assert load_policy_file(packaged_policy_dir() / "rag-adaptive.yaml").extraction == default.extraction
    assert ExtractionPolicy().scorer == "fused" and not ExtractionPolicy().expand_query


def hop_request(question: str) -> CompressionInput:
    distractors = [
        Document(
            text=f"Topic {i} is a town in county {i}. It has {i} churches and a market.", title=f"Town {i}"
        )
        for i in range(6)
    ]
    return CompressionInput(
        messages=[{"role": "user", "content": question}], documents=[KISS, *distractors, TEMPLE]
    )


def hop_policy(extraction: dict) -> Policy:
    return Policy(
        name="hop",
        max_input_tokens=400,
        documents={"max_tokens": 105},
        rerank={"top_k": None},
        extraction=extraction,
        dedup={"enabled": False},
    )


@pytest.mark.parametrize("extraction", [{"scorer": "learned"}, {"expand_query": True}])
def test_the_bridge_passage_keeps_its_answer_under_a_tight_budget(make_pipeline, extraction):
    result = asyncio.run(make_pipeline().run(hop_request(BRIDGE_QUESTION), hop_policy(extraction)))
    assert result.prompt_tokens < result.original_prompt_tokens / 2
    assert "Chief of Protocol" in result.context_text


def test_single_hop_scoring_misses_the_bridge_passage_under_the_same_budget(make_pipeline):
    result = asyncio.run(make_pipeline().run(hop_request(BRIDGE_QUESTION), hop_policy({})))
    assert "Corliss Archer" in result.context_text
    assert "Shirley Temple Black" not in result.context_text
