"""Builds the `ModelRouter` of a model list (`ctxgate.gateway.model_list_config`) from the gateway's settings.

HTTP deployments are `UpstreamClient`s of one URL each, with the server's timeouts and retries: the
group does the failover, the ejection and the health probes, so the client's own skip-after-failure
is off. `server.upstreams`, given with a model list, is one more group (least outstanding) under the
served model name.
"""

from __future__ import annotations

from ctxgate.backend.engine.api import EngineClient
from ctxgate.backend.routing.deployment_health import DeploymentHealth, HealthPolicy
from ctxgate.backend.routing.deployment_metrics import DeploymentMetrics
from ctxgate.backend.routing.model_group import Deployment, ModelGroup
from ctxgate.backend.routing.model_router import ModelRouter
from ctxgate.backend.routing.strategies import make_router
from ctxgate.backend.routing.upstream import UpstreamClient, UpstreamConfig
from ctxgate.backend.routing.upstream_metrics import upstream_label
from ctxgate.gateway.model_list_config import DeploymentConfig, ModelConfig
from ctxgate.gateway.settings import GatewaySettings

BUILTIN = "builtin"


def with_upstreams(settings: GatewaySettings) -> list[ModelConfig]:
    """The model list, with `server.upstreams` as one more group when both are set."""
    models = list(settings.model_list)
    if settings.upstreams:
        name = settings.served_model_name or settings.upstream_model or "upstream"
        if any(model.model_name == name for model in models):
            raise ValueError(f"server.upstreams would serve '{name}', which model_list already names")
        models.append(
            ModelConfig(
                model_name=name,
                deployments=[
                    DeploymentConfig(url=url, model=settings.upstream_model) for url in settings.upstreams
                ],
            )
        )
    return models


def _upstream(settings: GatewaySettings, model: ModelConfig, entry: DeploymentConfig) -> Deployment:
    assert entry.url is not None
    config = UpstreamConfig(
        urls=[entry.url],
        model=entry.model,
        api_key=entry.api_key or settings.upstream_api_key,
        connect_timeout_s=settings.upstream_connect_timeout_s,
        read_timeout_s=settings.upstream_read_timeout_s,
        retries=settings.upstream_retries,
        down_for_s=0.0,
    )
    return Deployment(
        name=upstream_label(entry.url),
        client=UpstreamClient(config, served_model_name=model.model_name),
        weight=entry.weight,
        max_parallel=entry.max_parallel_requests,
        health_url=_health_url(entry.url),
        health=DeploymentHealth(_health_policy(model)),
    )


def _health_url(url: str) -> str:
    base = url[: -len("/v1")] if url.endswith("/v1") else url
    return f"{base}/health"


def _health_policy(model: ModelConfig) -> HealthPolicy:
    health = model.health
    return HealthPolicy(
        failures_to_eject=health.failures_to_eject,
        eject_s=health.eject_s,
        max_eject_s=health.max_eject_s,
        probe_interval_s=health.probe_interval_s,
    )


def build_router(settings: GatewaySettings, builtin: EngineClient | None, owns_builtin: bool) -> ModelRouter:
    """The served models of `settings`; `builtin` is the in-process engine for `engine: builtin`."""
    metrics = DeploymentMetrics()
    groups = []
    for model in with_upstreams(settings):
        deployments = []
        for entry in model.deployments:
            if entry.url is not None:
                deployments.append(_upstream(settings, model, entry))
                continue
            if builtin is None:
                raise ValueError(
                    f"model '{model.model_name}' names the built-in engine, which is not running"
                )
            deployments.append(
                Deployment(
                    name=BUILTIN,
                    client=builtin,
                    weight=entry.weight,
                    max_parallel=entry.max_parallel_requests,
                    owned=owns_builtin,
                    health=DeploymentHealth(_health_policy(model)),
                )
            )
        groups.append(
            ModelGroup(
                model.model_name,
                deployments,
                make_router(model.routing, model.load_factor),
                metrics,
                probe_interval_s=model.health.probe_interval_s,
            )
        )
    fallbacks = {model.model_name: list(model.fallbacks) for model in settings.model_list if model.fallbacks}
    registry = builtin.metrics_registry if builtin is not None else None
    return ModelRouter(groups, fallbacks, metrics, builtin_registry=registry)
