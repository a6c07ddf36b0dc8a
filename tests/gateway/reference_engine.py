"""A small, real `EngineClient` over Hugging Face transformers, for gateway tests.

It runs the actual default model (greedy or sampled, with a KV cache), one request at a time. The
gateway tests use `backend.async_engine.AsyncEngine` when that module exists and this otherwise, so
they exercise real generation either way.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

from backend.api import GenerationDelta, GenerationRequest, RequestMetrics
from backend.tokenizer import IncrementalDetokenizer, load_tokenizer


class ReferenceEngine:
    def __init__(self, model_dir: str, max_model_len: int = 8192):
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self.model_name = "SmolLM2-135M-Instruct"
        self.max_model_len = max_model_len
        self.tokenizer = load_tokenizer(str(model_dir))
        self._model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self._lock = threading.Lock()  # one forward at a time, whichever event loop asks
        self._aborted: set[str] = set()
        self.aborted_ids: list[str] = []
        self.started_ids: list[str] = []

    def is_ready(self) -> bool:
        return True

    async def abort(self, request_id: str) -> None:
        if request_id not in self._aborted:
            self._aborted.add(request_id)
            self.aborted_ids.append(request_id)

    def _step(self, input_ids, past, temperature: float, generator):
        torch = self._torch
        with self._lock, torch.inference_mode():
            output = self._model(input_ids=input_ids, past_key_values=past, use_cache=True)
            logits = output.logits[0, -1]
            if temperature <= 0:
                token = int(torch.argmax(logits))
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
        return token, output.past_key_values

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        torch = self._torch
        self.started_ids.append(request.request_id)
        sampling = request.sampling
        generator = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else 0)
        detok = IncrementalDetokenizer(self.tokenizer)
        queued = time.perf_counter()
        input_ids = torch.tensor([request.prompt_token_ids])
        past = None
        produced: list[int] = []
        first_at: float | None = None
        finish = "length"
        prefill_ms = 0.0
        while len(produced) < sampling.max_tokens:
            if request.request_id in self._aborted:
                finish = "abort"
                break
            step_start = time.perf_counter()
            token, past = await asyncio.to_thread(self._step, input_ids, past, sampling.temperature, generator)
            if first_at is None:
                first_at = time.perf_counter()
                prefill_ms = (first_at - step_start) * 1000
            if token in self.tokenizer.eos_token_ids and not sampling.ignore_eos:
                finish = "stop"
                break
            produced.append(token)
            input_ids = torch.tensor([[token]])
            text = detok.add([token])
            if sampling.stop and any(stop in detok.text for stop in sampling.stop):
                finish = "stop"
                yield GenerationDelta(request.request_id, text, [token])
                break
            yield GenerationDelta(request.request_id, text, [token])
        ended = time.perf_counter()
        first_at = first_at or ended
        yield GenerationDelta(
            request.request_id, detok.flush(), [], finish_reason=finish,
            prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(produced),
            metrics=RequestMetrics(
                queue_ms=0.0, prefill_ms=prefill_ms, ttft_ms=(first_at - queued) * 1000,
                tpot_ms=(ended - first_at) * 1000 / max(1, len(produced) - 1), e2e_ms=(ended - queued) * 1000,
            ),
        )
