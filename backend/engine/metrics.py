"""Prometheus metrics of one engine instance, with vLLM-style names under the `ctxgate:` prefix.

Each `EngineMetrics` owns its own `CollectorRegistry`: tests (and a gateway with several engines)
create more than one engine per process, and the default global registry refuses duplicate names.
The standalone server and the gateway expose `EngineMetrics.registry` on their `/metrics`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

if TYPE_CHECKING:
    from ctxgate.backend.engine.api import GenerationDelta
    from ctxgate.backend.engine.engine_stats import EngineStats

PREFIX = "ctxgate:"

# Latency buckets in seconds. Dense where this engine lives (10 ms .. a few s) so that P50/P95/P99
# interpolated from the histogram land within a few percent of the true quantile.
_FAST_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.0125,
    0.015,
    0.0175,
    0.02,
    0.025,
    0.03,
    0.035,
    0.04,
    0.05,
    0.06,
    0.075,
    0.1,
    0.125,
    0.15,
    0.2,
    0.25,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
_REQUEST_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.25,
    1.5,
    1.75,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    6.0,
    8.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    60.0,
    90.0,
    120.0,
    180.0,
    300.0,
)
_TOKEN_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class EngineMetrics:
    """All engine metrics, recorded from the engine thread (prometheus-client is thread-safe)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        self._model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        def counter(name: str, doc: str, extra_labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra_labels), registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Time from arrival to the first output token.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between two consecutive output tokens of a request.",
            _FAST_LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token after the first, per finished request.",
            _FAST_LATENCY_BUCKETS,
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds",
            "Time from arrival to the last output token.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time a request waited before its first scheduled step.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Time spent prefilling a request's prompt.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", _TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", _TOKEN_COUNT_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens processed per engine step.", _TOKEN_COUNT_BUCKETS
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = counter(
            "request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        # A shadow request (Priority.SHADOW: the gateway's uncompressed replay of a live one) waits
        # behind every live request by design; in the live figures its latency would read as the
        # users' own. It is counted here alone.
        self.shadow_requests = counter(
            "shadow_requests",
            "Finished shadow requests (the gateway's quality checks) by finish reason; they are in "
            "no other per-request, latency or token metric of the engine.",
            ("finished_reason",),
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self.ttft_target_misses = counter(
            "ttft_target_misses", "Requests whose time to first token exceeded the configured target."
        )
        self.interleaved_prefills = counter(
            "interleaved_prefills",
            "Requests prefilled between two decoder layers of another step (CPU: engine.interleaved_prefill_tokens).",
        )
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.num_kv_blocks_total = gauge("num_kv_blocks_total", "KV cache blocks in the pool.")
        self.num_kv_blocks_free = gauge("num_kv_blocks_free", "Free KV cache blocks.")
        self.batch_size = gauge("last_step_batch_size", "Sequences in the last engine step.")
        # ctxgate:engine_path_info{device, dtype, cpu_kernel_isa, cpu_flags, matmul, ...} 1
        self.path_info = Info(
            PREFIX + "engine_path", "The compute path this engine runs.", labels, registry=self.registry
        )

        # Create every labelled series now so /metrics shows zeros before the first request.
        for metric in (
            self.time_to_first_token,
            self.inter_token_latency,
            self.time_per_output_token,
            self.e2e_latency,
            self.queue_time,
            self.prefill_time,
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.iteration_tokens,
            self.prompt_tokens,
            self.generation_tokens,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.num_preemptions,
            self.ttft_target_misses,
            self.interleaved_prefills,
            self.num_requests_running,
            self.num_requests_waiting,
            self.kv_cache_usage,
            self.num_kv_blocks_total,
            self.num_kv_blocks_free,
            self.batch_size,
        ):
            self._label(metric)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name=model_name, finished_reason=reason)
            self.shadow_requests.labels(model_name=model_name, finished_reason=reason)

        # Cumulative engine counters arrive as totals; counters are advanced by the difference.
        self._last_totals = {"queried": 0, "hits": 0, "preemptions": 0, "ttft_misses": 0, "interleaved": 0}

    def set_path_info(self, info: dict[str, object]) -> None:
        values = {
            key: " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
            for key, value in info.items()
        }
        self._label(self.path_info).info(values)

    def _label(self, metric):
        return metric.labels(model_name=self._model_name)

    def observe_step_tokens(self, num_new_tokens: int) -> None:
        if num_new_tokens:
            self._label(self.generation_tokens).inc(num_new_tokens)

    def observe_inter_token(self, seconds: float) -> None:
        self._label(self.inter_token_latency).observe(seconds)

    def observe_finished(self, delta: GenerationDelta, shadow: bool = False) -> None:
        """Record one finished (or aborted) request from its final delta; a shadow request only in
        `shadow_requests`."""
        if shadow:
            self.shadow_requests.labels(
                model_name=self._model_name, finished_reason=delta.finish_reason or "unknown"
            ).inc()
            return
        self.request_success.labels(
            model_name=self._model_name, finished_reason=delta.finish_reason or "unknown"
        ).inc()
        self._label(self.prompt_tokens).inc(delta.prompt_tokens)
        self._label(self.request_prompt_tokens).observe(delta.prompt_tokens)
        self._label(self.request_generation_tokens).observe(delta.completion_tokens)
        metrics = delta.metrics
        if metrics is None or delta.finish_reason == "abort":
            return
        self._label(self.queue_time).observe(metrics.queue_ms / 1000)
        self._label(self.prefill_time).observe(metrics.prefill_ms / 1000)
        self._label(self.time_to_first_token).observe(metrics.ttft_ms / 1000)
        self._label(self.e2e_latency).observe(metrics.e2e_ms / 1000)
        if delta.completion_tokens > 1:
            self._label(self.time_per_output_token).observe(metrics.tpot_ms / 1000)

    def update_from_stats(self, stats: EngineStats) -> None:
        """Refresh gauges and advance counters from the engine's cumulative statistics."""
        self._label(self.num_requests_running).set(stats.num_running)
        self._label(self.num_requests_waiting).set(stats.num_waiting)
        self._label(self.kv_cache_usage).set(stats.kv_cache_usage)
        self._label(self.num_kv_blocks_total).set(stats.num_kv_blocks_total)
        self._label(self.num_kv_blocks_free).set(stats.num_kv_blocks_free)
        self._label(self.batch_size).set(stats.last_step_batch_size)
        totals = {
            "queried": stats.prefix_cache_queried_tokens,
            "hits": stats.prefix_cache_hit_tokens,
            "preemptions": stats.num_preemptions,
            "ttft_misses": stats.ttft_target_misses,
            "interleaved": stats.num_interleaved_prefills,
        }
        counters = {
            "queried": self.prefix_cache_queries,
            "hits": self.prefix_cache_hits,
            "preemptions": self.num_preemptions,
            "ttft_misses": self.ttft_target_misses,
            "interleaved": self.interleaved_prefills,
        }
        for key, total in totals.items():
            increase = total - self._last_totals[key]
            if increase > 0:
                self._label(counters[key]).inc(increase)
                self._last_totals[key] = total

    def observe_step(self, num_tokens: int) -> None:
        if num_tokens:
            self._label(self.iteration_tokens).observe(num_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of this engine's metrics."""
        return generate_latest(self.registry)


# Engine metrics whose meaning matches vLLM's metric of the same name (vLLM v1), so dashboards and
# autoscalers written for vLLM (e.g. on vllm:num_requests_waiting) work unchanged.
VLLM_COMPATIBLE = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens_total",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
)
VLLM_PREFIX = "vllm:"


class _VllmNames:
    """Re-exports the vLLM-compatible engine metrics under `vllm:` names (the `ctxgate:` ones stay)."""

    def __init__(self, metrics: EngineMetrics):
        names = {PREFIX + name for name in VLLM_COMPATIBLE}
        self._sources = [
            value
            for value in vars(metrics).values()
            if hasattr(value, "collect") and getattr(value, "_name", None) in names
        ]

    def describe(self):
        return []  # no name reservation: the registry's own metrics already own the ctxgate: names

    def collect(self):
        for source in self._sources:
            for family in source.collect():
                family.name = VLLM_PREFIX + family.name[len(PREFIX) :]
                family.samples = [
                    sample._replace(name=VLLM_PREFIX + sample.name[len(PREFIX) :])
                    for sample in family.samples
                ]
                yield family


def export_vllm_names(metrics: EngineMetrics) -> None:
    """Also expose the engine's vLLM-compatible metrics as `vllm:*` on the same registry."""
    metrics.registry.register(_VllmNames(metrics))
