"""`EngineStats`: one snapshot of the engine's queues, KV pool and cumulative counters, taken between
steps (`LLMEngine.stats`); the metrics' gauges and the gateway's load signals read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    kv_cache_usage: float
    prefix_cache_queried_tokens: int  # cumulative
    prefix_cache_hit_tokens: int  # cumulative
    num_preemptions: int  # cumulative
    kv_bytes_per_token: int
    ttft_target_misses: int  # cumulative
    last_step_batch_size: int
    last_step_num_tokens: int
    # Prompt tokens still to prefill (waiting sequences whole, running ones' unfinished chunks) and
    # the scheduler's measured prefill speed: what a new request would queue behind, and how fast.
    num_waiting_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    num_interleaved_prefills: int = 0  # cumulative: requests prefilled inside another step
