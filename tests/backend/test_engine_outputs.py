"""What the engine returns beyond token ids: log probabilities (checked against a float32 Hugging Face
forward), n choices forked on the prompt's KV blocks, penalties, logit bias and grammar masks."""

from __future__ import annotations

import json

import pytest
import torch

from ctxgate.backend.engine.api import GenerationRequest, SamplingParams
from ctxgate.backend.engine.guided import GuideSpec, compiler_for

PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(block_size=16, num_kv_blocks=64, max_num_seqs=8, max_model_len=256)


def _run(engine, prompt_ids, sampling, request_id="r"):
    engine.add_request(GenerationRequest(request_id, prompt_ids, sampling))
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(d for d in engine.step() if d.request_id == request_id)
    return deltas


def test_logprobs_match_a_float32_hugging_face_forward(engine, model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    prompt = tokenizer.encode(PROMPT)
    deltas = _run(engine, prompt, SamplingParams(max_tokens=3, temperature=0, logprobs=3), "lp")
    generated = [d.token_ids[0] for d in deltas]
    entries = [d.logprobs[0] for d in deltas]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for position, entry in enumerate(entries):
        assert entry.token_id == generated[position]
        assert entry.top[0][0] == int(reference[position].argmax())  # top-1 identical
        assert abs(entry.logprob - float(reference[position, entry.token_id])) < 1e-2
        assert [t for t, _ in entry.top] == reference[position].topk(3).indices.tolist()


def test_n_choices_share_the_prompt_blocks(engine, tokenizer):
    prompt = tokenizer.encode(PROMPT * 6)  # several full blocks
    sampling = SamplingParams(max_tokens=2, temperature=1.0, seed=5, n=4, ignore_eos=True)

    def peak_blocks(requests):
        for request_id, params in requests:
            engine.add_request(GenerationRequest(request_id, prompt, params))
        peak, finished, choices = 0, set(), set()
        while engine.has_unfinished_requests():
            for delta in engine.step():
                choices.add((delta.request_id, delta.index))
                if delta.finish_reason:
                    finished.add(delta.request_id)
            used = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
            holders = [s for g in engine.sequences.values() for s in g.sequences if s.block_table]
            engine.block_manager.check_invariants(holders=holders)
            peak = max(peak, used)
        assert finished == {r for r, _ in requests}
        return peak, choices

    forked, choices = peak_blocks([("n4", sampling)])
    assert choices == {("n4", i) for i in range(4)}
    single = SamplingParams(max_tokens=2, temperature=1.0, seed=5, ignore_eos=True)
    separate, _ = peak_blocks([(f"s{i}", single) for i in range(4)])
    assert forked < separate


def test_logit_bias_forces_the_greedy_token(engine, tokenizer):
    prompt = tokenizer.encode("one one one one one one")
    biased = _run(engine, prompt, SamplingParams(max_tokens=1, temperature=0, logit_bias={7: 100.0}), "p1")
    assert biased[0].token_ids[0] == 7


def test_json_schema_guide_makes_parseable_output(engine, tokenizer):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 20},
            "ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
        },
        "required": ["answer", "ids"],
        "additionalProperties": False,
    }
    guide = compiler_for(tokenizer).compile_now(GuideSpec.json_schema(schema, "response_format"))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Answer in JSON: capital of France?"}])
    deltas = _run(engine, prompt, SamplingParams(max_tokens=60, temperature=0, guide=guide), "g")
    parsed = json.loads("".join(d.text for d in deltas))
    assert set(parsed) == {"answer", "ids"} and deltas[-1].finish_reason == "stop"


def test_a_bad_grammar_is_a_guide_error_naming_the_field(tokenizer):
    from ctxgate.backend.engine.guided import GuideError

    with pytest.raises(GuideError, match="guided_grammar could not be compiled") as caught:
        compiler_for(tokenizer).compile_now(GuideSpec("grammar", "root ::= (", "guided_grammar"))
    assert "/" not in str(caught.value).split(":", 1)[1]  # no source paths of the library
