"""The synchronous engine: requests in, one scheduler iteration per `step()`, deltas out.

Used from a single thread (the async wrapper's engine thread), so it holds no locks.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import replace

import torch

from ctxgate.backend.engine.api import (
    SHADOW_PREEMPTED,
    EngineError,
    GenerationDelta,
    GenerationRequest,
    SamplingParams,
    check_weight,
)
from ctxgate.backend.engine.block_manager import BlockManager
from ctxgate.backend.engine.config import EngineConfig
from ctxgate.backend.engine.engine_stats import EngineStats
from ctxgate.backend.engine.interleaved_prefill import InterleavedPrefill
from ctxgate.backend.engine.isolated_step import StepRun, run_step
from ctxgate.backend.engine.model_runner import ModelRunner
from ctxgate.backend.engine.output_processor import OutputProcessor, finished_metrics
from ctxgate.backend.engine.path_info import compute_path_info, compute_path_summary
from ctxgate.backend.engine.sampler import SampledToken
from ctxgate.backend.engine.sampling_checks import SamplingParamError, admitted
from ctxgate.backend.engine.scheduler import Scheduler, SchedulerOutput
from ctxgate.backend.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from ctxgate.backend.engine.startup import (
    build_decode_graphs,
    check_device_support,
    kv_pool_blocks,
    resolve_device,
    resolve_dtype,
    use_decode_graphs,
    use_traced_decode,
)
from ctxgate.backend.model.attention import create_backend
from ctxgate.backend.model.kv_cache import KVCache, KVCacheSpec
from ctxgate.backend.model.model_loader import load_model
from ctxgate.backend.model.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from ctxgate.backend.model.model_prepare import resolve_model_path

        config.validate()
        self.config = config
        self.num_threads = config.num_threads or os.cpu_count() or 1
        torch.set_num_threads(self.num_threads)
        model_path = resolve_model_path(config.model)
        self.model_name = model_path.name
        self.device = resolve_device(config.device)
        check_device_support(config, self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.tokenizer: Tokenizer = load_tokenizer(str(model_path))
        self.model = load_model(model_path, self.dtype, self.device, config.weight_quant)
        arch = self.model.config
        self.attention = create_backend(
            config.attention_backend, self.device, arch.num_heads, arch.num_kv_heads, arch.head_dim
        )
        graphs = use_decode_graphs(config, self.device, self.attention)

        spec = KVCacheSpec(
            num_layers=arch.num_layers,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            block_size=config.block_size,
            dtype=self.dtype,
            quantized=config.kv_cache_dtype == "int8",
        )
        num_blocks = kv_pool_blocks(config, self.device, self.model, spec, self.dtype)
        # A sequence longer than the whole pool could never be scheduled: cap the context there.
        self.max_model_len = min(
            config.max_model_len or min(arch.max_position_embeddings, DEFAULT_MAX_MODEL_LEN),
            num_blocks * config.block_size,
        )
        self.model.init_rotary(self.max_model_len)
        traced = not graphs and use_traced_decode(config, self.device, self.attention, self.model, spec)
        # Decode graphs pad batches with rows writing to a scratch block beyond the manager's pool.
        self.kv_cache = KVCache(spec, num_blocks + (1 if graphs or traced else 0), self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.ttft_target_ms,
            fair_queuing=config.fair_queuing,
        )
        decode_graphs = None
        if graphs or traced:
            decode_graphs = build_decode_graphs(
                config,
                self.model,
                self.kv_cache,
                self.attention,
                self.device,
                self.max_model_len,
                scratch_block=num_blocks,
                traced=traced,
            )
        self.runner = ModelRunner(self.model, self.kv_cache, self.attention, self.device, decode_graphs)
        self.interleaved = InterleavedPrefill(config.interleaved_prefill_tokens)
        self.vocab_size = arch.vocab_size
        self.sequences: dict[str, SequenceGroup] = {}  # request id -> its live sequences
        self._arrival_counter = itertools.count()
        self.outputs = OutputProcessor(
            self.tokenizer.eos_token_ids, self.max_model_len, config.ttft_target_ms
        )
        self.last_step_batch_size = 0
        self.last_step_num_tokens = 0
        self._failures: list[tuple[str, EngineError]] = []  # see take_failures
        logger.info(
            "engine ready: %s %s on %s, %d KV blocks of %d tokens (%s), attention=%s; %s",
            self.model_name,
            self.dtype,
            self.device,
            num_blocks,
            config.block_size,
            "int8" if spec.quantized else str(self.dtype),
            self.attention.name,
            self.cpu_path_summary(),
        )

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> None:
        if request.request_id in self.sequences:
            raise EngineError(f"duplicate request id {request.request_id!r}", 400)
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise EngineError("the prompt is empty", 400)
        if len(prompt) > self.max_model_len:
            raise EngineError(
                f"the prompt has {len(prompt)} tokens but the context window is {self.max_model_len} tokens",
                400,
            )
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise EngineError(f"prompt token ids must be in [0, {self.vocab_size})", 400)
        check_weight(request.weight)
        try:
            sampling = admitted(request.sampling, self.vocab_size, self.config.max_num_seqs)
        except SamplingParamError as exc:
            raise EngineError(str(exc), 400, param=exc.param, code="invalid_value") from None
        request = replace(request, prompt_token_ids=prompt, sampling=sampling)
        seq = self._new_sequence(request, index=0)
        self.sequences[request.request_id] = SequenceGroup(
            request.request_id, [seq], pending_forks=sampling.n - 1, unfinished=sampling.n
        )
        self.scheduler.add(seq)

    def _new_sequence(self, request: GenerationRequest, index: int) -> Sequence:
        sampling = request.sampling
        prompt = list(request.prompt_token_ids)
        seq = Sequence(
            request_id=request.request_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            max_tokens=max(1, min(sampling.max_tokens, self.max_model_len - len(prompt))),
            arrival_order=next(self._arrival_counter),
            priority=request.priority,
            cache_salt=request.cache_salt,
            tenant=request.tenant,
            weight=request.weight,
            index=index,
        )
        if request.arrival_time is not None:
            seq.arrival_time = request.arrival_time
        if sampling.seed is not None:
            # Choice i draws from seed + i: reproducible, and the choices differ.
            seq.generator = torch.Generator(device=self.device).manual_seed((sampling.seed + index) % 2**64)
        if sampling.guide is not None:
            seq.matcher = sampling.guide.matcher()
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
        return seq

    def _fork(self, group: SequenceGroup, first: Sequence) -> None:
        """The first sequence's prompt is computed: start the other choices on its KV blocks."""
        request = GenerationRequest(
            group.request_id,
            first.prompt_token_ids,
            first.sampling,
            first.priority,
            first.cache_salt,
            arrival_time=first.arrival_time,
            tenant=first.tenant,
            weight=first.weight,
        )
        for index in range(1, group.pending_forks + 1):
            child = self._new_sequence(request, index)
            child.arrival_order = first.arrival_order  # the request's place in the queue, not a new one
            child.virtual_finish = first.virtual_finish  # and its fair share paid once, by the first
            child.first_scheduled_time = first.first_scheduled_time
            group.sequences.append(child)
            if self.scheduler.has_room(1) and self.block_manager.fork(first, child):
                self.scheduler.add_running(child)
            else:  # no room to run it now (or a prompt shorter than a block): admitted as usual
                self.block_manager.free(child)
                child.num_computed_tokens = 0
                self.scheduler.add(child)
        group.pending_forks = 0

    def abort_request(self, request_id: str) -> None:
        group = self.sequences.pop(request_id, None)
        if group is None:
            return
        for seq in group.sequences:
            if seq.status is not SequenceStatus.FINISHED:
                self.scheduler.remove(seq)
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[GenerationDelta]:
        """One iteration: schedule, run the model once, sample, and stream one delta per sampled token.

        A request whose sequence makes the forward pass, sampling or its output handling raise is
        aborted alone (`take_failures` hands out its error); the step goes on for the others.
        """
        output = self.scheduler.schedule()
        for seq in output.dropped:
            self._fail(
                seq.request_id,
                EngineError("shadow request dropped: real work needed its room", 503, code=SHADOW_PREEMPTED),
            )
        self.last_step_batch_size = len(output.scheduled)
        self.last_step_num_tokens = output.num_tokens
        if output.is_empty:
            return []
        started = time.perf_counter()
        with self.interleaved.outer_step(output.scheduled):
            run = run_step(self.runner, output.scheduled, self.tokenizer.eos_token_ids)
        finished_at = time.perf_counter()
        self.interleaved.raise_deferred()
        # The outer step's own time, for the prefill-speed estimate: without its nested steps.
        return self._conclude(run, finished_at - started - self.interleaved.nested_seconds, finished_at)

    def prefill_between_layers(self) -> list[GenerationDelta]:
        """At a decoder-layer boundary of the step in progress (`LlamaModel.between_layers`, on a CPU):
        prefill the waiting queue's head alone when it may jump into the step
        (`interleaved_prefill.py`: rules and invariants) and return its first token's delta (and any
        failure through `take_failures`); [] when none may. The outer step's batch is untouched."""
        if self.device.type != "cpu":
            return []  # see interleaved_prefill.py: on a GPU a layer boundary is not a point in time
        try:
            item = self.interleaved.next_request(self.scheduler)
            if item is None:
                return []
            started = time.perf_counter()
            # Out of the outer forward pass's inference mode, as a step between steps runs: what the
            # sampler keeps on a sequence (its prompt mask) must not become an inference tensor.
            with self.interleaved.nested(), torch.inference_mode(False):
                run = run_step(self.runner, [item], self.tokenizer.eos_token_ids, eager=True)
                finished_at = time.perf_counter()
                self.interleaved.nested_seconds += finished_at - started
                return self._conclude(run, finished_at - started, finished_at)
        except Exception as exc:  # not the request's own failure (run_step and _conclude keep those)
            self.interleaved.defer(exc)
            return []

    def _conclude(self, run: StepRun, seconds: float, finished_at: float) -> list[GenerationDelta]:
        """After a forward pass: computed tokens, failures, one delta per sampled token."""
        failed = {seq.request_id for seq, _ in run.failed}
        ran = [item for item in run.ran if item.seq.request_id not in failed]
        self.scheduler.update_from_output(SchedulerOutput(ran), seconds)
        for seq, error in run.failed:
            self._fail(seq.request_id, error)
        deltas = []
        for seq, token in run.sampled:
            if seq.request_id in failed:
                continue  # another choice of the same request failed: the request is over
            try:
                deltas.append(self._emit(seq, token, finished_at))
            except Exception:
                logger.exception("handling the token of request %s failed; it is aborted", seq.request_id)
                failed.add(seq.request_id)
                self._fail(
                    seq.request_id,
                    EngineError("the engine failed on this request's output", 500, code="engine_error"),
                )
        return [delta for delta in deltas if delta.request_id not in failed]

    def _emit(self, seq: Sequence, token: SampledToken, now: float) -> GenerationDelta:
        group = self.sequences[seq.request_id]
        if group.pending_forks and seq.num_output_tokens == 0:
            self._fork(group, seq)
        delta = self.outputs.append_token(seq, token.token_id, now, token.logprob)
        if delta.choice_finish_reason is not None:
            self._finish(group, seq, delta, now)
        return delta

    def _fail(self, request_id: str, error: EngineError) -> None:
        self.abort_request(request_id)  # nothing to abort when its last token just finished it
        self._failures.append((request_id, error))

    def take_failures(self) -> list[tuple[str, EngineError]]:
        """The requests the last steps aborted because they failed, with the error each ends with."""
        failures, self._failures = self._failures, []
        return failures

    def _finish(self, group: SequenceGroup, seq: Sequence, delta: GenerationDelta, now: float) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = delta.choice_finish_reason
        seq.finish_time = now
        self.scheduler.remove(seq)
        group.unfinished -= 1
        group.completion_tokens += seq.num_output_tokens
        if group.unfinished > 0:
            return
        # The request's last choice: the delta that ends the request carries its totals.
        self.sequences.pop(seq.request_id, None)
        delta.finish_reason = delta.choice_finish_reason
        delta.prompt_tokens = seq.num_prompt_tokens
        delta.completion_tokens = group.completion_tokens
        delta.metrics = finished_metrics(group.sequences[0], now)

    # ---- introspection -----------------------------------------------------------------------
    def path_info(self) -> dict[str, object]:
        """Which compute path this engine runs: shown on /v1/models, in metrics and bench reports."""
        return compute_path_info(self)

    def cpu_path_summary(self) -> str:
        return compute_path_summary(self)

    def stats(self) -> EngineStats:
        total = self.block_manager.num_blocks
        free = self.block_manager.num_free_blocks
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_total=total,
            num_kv_blocks_free=free,
            kv_cache_usage=(total - free) / total if total else 0.0,
            prefix_cache_queried_tokens=self.scheduler.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=self.scheduler.prefix_cache_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            kv_bytes_per_token=self.kv_cache.spec.kv_bytes_per_token,
            ttft_target_misses=self.outputs.ttft_target_misses,
            last_step_batch_size=self.last_step_batch_size,
            last_step_num_tokens=self.last_step_num_tokens,
            num_waiting_tokens=self.scheduler.num_prefill_tokens_left(),
            prefill_tokens_per_s=self.scheduler.prefill_tokens_per_s,
            num_interleaved_prefills=self.interleaved.count,
        )

    # ---- sync helper ---------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Add all prompts, step until they finish, return each prompt's generated token ids."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        request_ids = [f"generate-{next(self._arrival_counter)}-{i}" for i in range(len(prompts))]
        outputs: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
        for request_id, prompt, sampling_params in zip(request_ids, prompts, params, strict=True):
            self.add_request(GenerationRequest(request_id, list(prompt), sampling_params))
        pending = set(request_ids)
        while pending:
            deltas = self.step()
            for request_id, error in self.take_failures():
                if request_id in pending:
                    raise error
            for delta in deltas:
                if delta.request_id in outputs:
                    outputs[delta.request_id].extend(delta.token_ids)
                    if delta.finish_reason is not None:
                        pending.discard(delta.request_id)
            if pending and not self.has_unfinished_requests():
                raise RuntimeError("engine stopped with unfinished generate() requests")
        return [outputs[request_id] for request_id in request_ids]
