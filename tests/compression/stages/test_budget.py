"""Token accounting (compression/stages/budget.py): how the stages price passages."""

from __future__ import annotations

from ctxgate.policies.schema import Policy
from tests.compression.stages.support import DOCUMENTS, setup_state


def test_split_passages_are_priced_by_sentence_and_a_changed_body_is_not_tokenized_again(tokenizer):
    from ctxgate.compression.counting import CachedCounter
    from ctxgate.compression.stages.budget import passages_tokens
    from ctxgate.compression.stages.prepare import ensure_sentences

    class Recording:
        def __init__(self):
            self.texts: list[str] = []
            self.max_token_bytes = tokenizer.max_token_bytes

        def count(self, text: str) -> int:
            self.texts.append(text)
            return tokenizer.count(text)

        def count_many(self, texts: list[str]) -> list[int]:
            return [self.count(text) for text in texts]

        def count_chat(self, messages, add_generation_prompt=True) -> int:
            return tokenizer.count_chat(messages, add_generation_prompt)

        def render_chat(self, messages, add_generation_prompt=True) -> str:
            return tokenizer.render_chat(messages, add_generation_prompt)

    state, ctx = setup_state(tokenizer, Policy(name="p"), documents=DOCUMENTS[:2])
    ensure_sentences(ctx, state.passages)
    first = state.passages[0]
    assert first.body_sentences() == first.sentences and len(first.sentences) == 2
    recording = Recording()
    counter = CachedCounter(recording)
    priced = passages_tokens(counter, state.passages)
    assert set(recording.texts) == {s for p in state.passages for s in p.sentences}
    assert abs(priced - sum(tokenizer.count(p.text) for p in state.passages)) <= 2 * len(state.passages)

    first.removed_sentences.add(0)
    recording.texts.clear()
    after = passages_tokens(counter, state.passages)
    assert first.body_sentences() == first.sentences[1:] and first.body() == first.sentences[1]
    assert after == priced - tokenizer.count(first.sentences[0]) and recording.texts == []
