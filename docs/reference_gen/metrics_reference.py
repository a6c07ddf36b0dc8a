"""The metrics reference page: every Prometheus metric, read from the registries the gateway and
the engine build."""

from __future__ import annotations

import dataclasses
from typing import Any

from reference_gen.fields import cell


@dataclasses.dataclass
class MetricDoc:
    name: str  # as exported (counters with _total)
    type: str
    labels: tuple[str, ...]
    help: str


def _exported_name(name: str, kind: str) -> str:
    if kind == "counter" and not name.endswith("_total"):
        return name + "_total"
    if kind == "info" and not name.endswith("_info"):
        return name + "_info"
    return name


_SERIES_LABELS = {"le", "quantile"}  # a histogram's or summary's own, not the metric's


def registry_metrics(registry: Any, owners: tuple[Any, ...] = ()) -> list[MetricDoc]:
    """Every metric a registry exports. Label names come from the metric objects (a labelled metric
    has no series until first used); collectors that build families at scrape time give theirs."""
    from prometheus_client.metrics import MetricWrapperBase

    docs: dict[str, MetricDoc] = {}
    for owner in owners:
        for value in vars(owner).values():
            if isinstance(value, MetricWrapperBase):
                name = _exported_name(value._name, value._type)
                docs[name] = MetricDoc(name, value._type, tuple(value._labelnames), value._documentation)
    for family in registry.collect():
        name = _exported_name(family.name, family.type)
        if name in docs:
            continue
        labels = sorted({label for sample in family.samples for label in sample.labels} - _SERIES_LABELS)
        docs[name] = MetricDoc(name, family.type, tuple(labels), family.documentation)
    return sorted(docs.values(), key=lambda doc: doc.name)


def metric_groups() -> list[tuple[str, str, list[MetricDoc]]]:
    """(title, note, metrics) per source, each built on a fresh registry of its own."""
    from ctxgate.backend.engine.metrics import VLLM_PREFIX, EngineMetrics, export_vllm_names
    from ctxgate.backend.routing.upstream import UpstreamClient, UpstreamConfig
    from ctxgate.gateway.admission import AdmissionCollector, AdmissionController
    from ctxgate.gateway.metrics import GatewayMetrics

    gateway = GatewayMetrics()
    gateway.registry.register(AdmissionCollector(AdmissionController(64, 64, 10.0)))
    all_gateway = registry_metrics(gateway.registry, (gateway, gateway.shadow))
    process = [doc for doc in all_gateway if not doc.name.startswith("ctxgate:")]
    own = [doc for doc in all_gateway if doc.name.startswith("ctxgate:")]

    upstream_client = UpstreamClient(UpstreamConfig(urls=["http://engine:8001"]))
    upstream = registry_metrics(upstream_client.metrics.registry, (upstream_client.metrics,))

    from ctxgate.backend.routing.deployment_metrics import DeploymentMetrics, DeploymentState

    deployment_metrics = DeploymentMetrics()
    deployment_metrics.watch(lambda: [DeploymentState("chat", "http://engine-1:8001/v1", 0, True)])
    deployments = registry_metrics(deployment_metrics.registry, (deployment_metrics,))

    engine = EngineMetrics("model")
    plain = {doc.name for doc in registry_metrics(engine.registry, (engine,))}
    export_vllm_names(engine)
    everything = registry_metrics(engine.registry, (engine,))
    engine_docs = [doc for doc in everything if doc.name in plain]
    vllm = [doc for doc in everything if doc.name.startswith(VLLM_PREFIX)]
    return [
        (
            "Gateway",
            "Requests, compression, tokens, spend, quotas, policies and admission "
            "(`gateway/metrics.py`, `gateway/admission.py`).",
            own,
        ),
        (
            "Upstreams",
            "In upstream mode, per upstream URL (credentials removed from the label) "
            "(`backend/routing/upstream_metrics.py`).",
            upstream,
        ),
        (
            "Model groups",
            "With a `model_list`, per served model and deployment (a URL without credentials, or "
            "`builtin`) (`backend/routing/deployment_metrics.py`; [Routing](../routing.md)).",
            deployments,
        ),
        (
            "Engine",
            "The built-in engine, on the gateway's `/metrics` (in-process engine) and on "
            "`ctxgate engine serve`'s (`backend/engine/metrics.py`).",
            engine_docs,
        ),
        (
            "vLLM names",
            "With `metrics.vllm_names` (or `--vllm-metric-names`), the engine's "
            "vLLM-compatible metrics are exported a second time under vLLM's names, so dashboards and "
            "autoscalers written for vLLM work unchanged.",
            vllm,
        ),
        ("Process", "The gateway process's own (prometheus-client's standard collectors).", process),
    ]


def metrics_page() -> str:
    out = [
        "# Metrics reference\n\n",
        "Every Prometheus metric on `/metrics`, read from the metric registries the gateway and "
        "the engine build (generated at build time). Counters are listed with their `_total` "
        "suffix and histograms by their base name (`_bucket`, `_sum` and `_count` series); "
        "prometheus-client also exports a `_created` timestamp beside each counter and histogram "
        "(`PROMETHEUS_DISABLE_CREATED_SERIES=True` turns those off). "
        "Dashboards and alerts: [Deploying](../deploying.md#metrics-logs-and-the-dashboard).\n",
    ]
    for title, note, docs in metric_groups():
        out.append(
            f"\n## {title}\n\n{note}\n\n| Metric | Type | Labels | Help |\n| --- | --- | --- | --- |\n"
        )
        for doc in docs:
            labels = ", ".join(f"`{label}`" for label in doc.labels)
            out.append(f"| `{doc.name}` | {doc.type} | {labels} | {cell(doc.help)} |\n")
    return "".join(out)
