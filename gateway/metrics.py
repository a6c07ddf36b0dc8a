"""Prometheus metrics of one gateway (own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from ctxgate.gateway.cache_metrics import CompressionCacheCollector
from ctxgate.gateway.shadow.metrics import ShadowMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_BUDGET_BUCKETS = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096, 8192)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # process_* (CPU, memory, open fds), python_info and python_gc_*: what every exporter carries.
        # They describe the whole process, so sharing the default instances between apps is correct.
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
        r.register(CompressionCacheCollector())
        self.requests = Counter(
            "ctxgate:gateway_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "ctxgate:gateway_request_seconds",
            "end-to-end request latency as the client sees it",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "ctxgate:gateway_ttft_seconds",
            "time to first token as the client sees it (incl. compression)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot_seconds = Histogram(
            "ctxgate:gateway_tpot_seconds",
            "time per output token after the first, as the client sees it",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.compression_seconds = Histogram(
            "ctxgate:compression_seconds",
            "compression time per stage",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.compression_wait_seconds = Histogram(
            "ctxgate:compression_wait_seconds",
            "time a compressing request waited for a compression worker",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens_original = Counter(
            "ctxgate:prompt_tokens_original",
            "prompt tokens before compression",
            ["tenant", "policy"],
            registry=r,
        )
        self.prompt_tokens_sent = Counter(
            "ctxgate:prompt_tokens_sent", "prompt tokens sent to the model", ["tenant", "policy"], registry=r
        )
        self.completion_tokens = Counter(
            "ctxgate:completion_tokens", "tokens generated", ["tenant", "policy"], registry=r
        )
        self.segment_tokens_original = Counter(
            "ctxgate:segment_tokens_original",
            "tokens per segment (system, history, documents, tools, question, output) before compression",
            ["tenant", "policy", "segment"],
            registry=r,
        )
        self.segment_tokens_sent = Counter(
            "ctxgate:segment_tokens_sent",
            "tokens per segment (system, history, documents, tools, question) sent to the model, "
            "and output generated",
            ["tenant", "policy", "segment"],
            registry=r,
        )
        self.saved_tokens = Counter(
            "ctxgate:saved_tokens",
            "prompt tokens saved per compression stage",
            ["stage", "policy"],
            registry=r,
        )
        self.spend = Counter(
            "ctxgate:spend", "cost accumulated per tenant", ["tenant", "currency"], registry=r
        )
        self.quota_rejections = Counter(
            "ctxgate:quota_rejections", "requests refused by a quota", ["tenant", "reason"], registry=r
        )
        self.quota_store_errors = Counter(
            "ctxgate:quota_store_errors",
            "quota store failures by the action taken (allow|deny)",
            ["action"],
            registry=r,
        )
        self.quota_store_up = Gauge(
            "ctxgate:quota_store_up", "1 when the last quota store call succeeded", registry=r
        )
        self.upstream_errors = Counter(
            "ctxgate:upstream_errors", "errors from the model backend by HTTP status", ["status"], registry=r
        )
        self.policy_reload_failures = Counter(
            "ctxgate:policy_reload_failures", "policy files that failed to (re)load", ["file"], registry=r
        )
        self.policy_reload_error = Gauge(
            "ctxgate:policy_reload_error",
            "1 while a policy file has an error and its old version is in force",
            ["file"],
            registry=r,
        )
        self.policies_loaded = Gauge("ctxgate:policies_loaded", "policies in force", registry=r)
        self.adaptive_budget_tokens = Histogram(
            "ctxgate:adaptive_budget_tokens",
            "documents budgets chosen by adaptive policies",
            ["policy"],
            buckets=_BUDGET_BUCKETS,
            registry=r,
        )
        self.adaptive_decisions = Counter(
            "ctxgate:adaptive_decisions",
            "adaptive budget decisions by reason (gateway/budget_control.py)",
            ["policy", "reason"],
            registry=r,
        )
        self.adaptive_slo_requests = Counter(
            "ctxgate:adaptive_slo_requests",
            "adaptive-policy requests by whether TTFT (compression + engine) met the policy's ttft_slo_s",
            ["policy", "met"],
            registry=r,
        )
        self.budget_rejections = Counter(
            "ctxgate:budget_rejections",
            "requests whose fixed parts alone exceed the budget (413)",
            ["policy"],
            registry=r,
        )
        self.fit_requests = Counter(
            "ctxgate:fit_requests",
            "requests over a limit (quota, context_window, max_input_tokens) by whether "
            "they were compressed to fit (fitted) or refused",
            ["policy", "limit", "outcome"],
            registry=r,
        )
        self.shadow = ShadowMetrics(r)
        self.quota_store_up.set(1)
