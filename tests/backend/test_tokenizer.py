from ctxgate.backend.model.tokenizer import IncrementalDetokenizer


def test_chat_template_and_counts(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tokenizer.render_chat(messages)
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.count_chat(messages) == len(tokenizer.encode(text))


def test_incremental_detokenizer_matches_full_decode(tokenizer):
    text = "Héllo wörld — naïve café, 日本語 and emoji 🎉 end."
    token_ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([token_id]) for token_id in token_ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(token_ids) == text
