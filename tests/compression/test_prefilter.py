from ctxgate.compression.prefilter import estimated_tokens, mark_embedding_candidates
from ctxgate.compression.state import Passage
from ctxgate.compression.types import Document
from ctxgate.policies.schema import DEFAULT_EMBED_BUDGET_MULTIPLE, DEFAULT_EMBED_MIN_SHARE

FILLER = [
    "The harbour was rebuilt in stone after the storm of the previous winter.",
    "Local fishermen sold their catch at the market every Thursday morning.",
    "A new road connected the village to the county town in the next decade.",
    "The parish church kept records of births and marriages from that time on.",
]


def passage(position: int, sentences: list[str], title: str | None = None) -> Passage:
    return Passage(Document(text=" ".join(sentences), title=title), position, sentences=list(sentences))


def chosen_texts(passages: list[Passage]) -> list[str]:
    return [p.sentences[i] for p in passages for i in sorted(p.embed_sentences or ())]


def test_short_input_embeds_every_sentence():
    passages = [passage(0, FILLER[:2]), passage(1, FILLER[2:])]
    assert mark_embedding_candidates("When was the harbour rebuilt?", passages, budget_tokens=1000) == 0
    assert all(p.embed_sentences is None for p in passages)


def test_the_question_matching_sentences_are_embedded_and_the_allowance_is_spent_just_past():
    answer = "The lighthouse on the north pier was first lit in 1868 by the harbour board."
    passages = [passage(i, FILLER) for i in range(6)] + [passage(6, [FILLER[0], answer])]
    total = sum(estimated_tokens(s) for p in passages for s in p.sentences)
    budget = 40
    allowance = max(DEFAULT_EMBED_BUDGET_MULTIPLE * budget, DEFAULT_EMBED_MIN_SHARE * total)
    assert allowance < total, "the input must be larger than the allowance for the filter to act"

    left_out = mark_embedding_candidates(
        "When was the lighthouse on the north pier first lit?", passages, budget
    )

    chosen = chosen_texts(passages)
    assert answer in chosen
    assert left_out == sum(len(p.sentences) for p in passages) - len(chosen)
    spent = sum(estimated_tokens(text) for text in chosen)
    # Sentences are taken best first until the allowance is reached: the last one crosses it.
    assert spent >= allowance
    assert spent - max(estimated_tokens(text) for text in chosen) < allowance


def test_the_policy_allowance_sets_how_much_is_embedded():
    answer = "The lighthouse on the north pier was first lit in 1868 by the harbour board."
    question = "When was the lighthouse on the north pier first lit?"

    def chosen_at(budget_multiple: float, min_share: float) -> list[str]:
        passages = [passage(i, FILLER) for i in range(6)] + [passage(6, [FILLER[0], answer])]
        mark_embedding_candidates(question, passages, 100, budget_multiple, min_share)
        return chosen_texts(passages)

    wide, narrow = chosen_at(0.8, 0.0), chosen_at(0.2, 0.0)
    assert answer in narrow and set(narrow) < set(wide)
    assert sum(estimated_tokens(text) for text in narrow) < 0.2 * 100 + estimated_tokens(answer)
    # The input share is a floor under a small multiple.
    assert len(chosen_at(0.2, 0.5)) > len(narrow)
