"""Wiring: `create_app(settings, engine=None, pipeline=None)` builds the gateway and its FastAPI app.

Tests and the eval harness run it in-process. Without an engine it starts the in-process engine, or
the HTTP upstream client when `settings.upstreams` is set. The routes are in `ctxgate.gateway.routes`, one
request's run in `ctxgate.gateway.generation`, start-up and shutdown in `ctxgate.gateway.lifecycle`.
"""

from __future__ import annotations

import logging
import time
from importlib.metadata import version as package_version
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from ctxgate.backend.engine.api import EngineClient
from ctxgate.backend.openai_api.errors import install_error_handlers
from ctxgate.backend.openai_api.http import (
    BodySizeLimit,
    document_request_bodies,
)
from ctxgate.gateway.admission import AdmissionCollector, AdmissionControl, AdmissionController, KeyOf
from ctxgate.gateway.admission_shares import Admittee
from ctxgate.gateway.console.admin_key import load_admin_key
from ctxgate.gateway.console.install import install_console
from ctxgate.gateway.cpu_share import TenantCpuShare
from ctxgate.gateway.keys import KeyStore
from ctxgate.gateway.lifecycle import lifespan
from ctxgate.gateway.metrics import GatewayMetrics
from ctxgate.gateway.middleware import RequestCounter
from ctxgate.gateway.prompt_building import Pipeline
from ctxgate.gateway.quota import Clock, create_store
from ctxgate.gateway.request_id import RequestId
from ctxgate.gateway.routes import add_routes
from ctxgate.gateway.schemas import ChatCompletionRequest, CompletionRequest
from ctxgate.gateway.service import Gateway
from ctxgate.gateway.settings import GatewaySettings
from ctxgate.policies.loader import PolicyRegistry, ReloadError, packaged_policy_dir

logger = logging.getLogger(__name__)

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/ctxgate/compress": ChatCompletionRequest,
}
ERROR_ANSWERS = {
    "400": "invalid request (OpenAI-style error object)",
    "401": "missing or invalid API key",
    "413": "body or prompt too large for the limit or policy budget",
    "429": "over quota; see Retry-After",
    "503": "overloaded or draining (error code 'overloaded'); see Retry-After",
}


# -- construction --------------------------------------------------------------------------------
def _default_engine(settings: GatewaySettings) -> EngineClient:
    if settings.model_list:
        from ctxgate.gateway.model_list_config import builtin_needed
        from ctxgate.gateway.router_setup import build_router

        builtin = (
            _builtin_engine(settings) if builtin_needed(settings.model_list, settings.upstreams) else None
        )
        return build_router(settings, builtin, owns_builtin=True)
    if settings.upstreams:
        from ctxgate.backend.routing.upstream import UpstreamClient, UpstreamConfig

        config = UpstreamConfig(
            urls=list(settings.upstreams),
            model=settings.upstream_model,
            connect_timeout_s=settings.upstream_connect_timeout_s,
            read_timeout_s=settings.upstream_read_timeout_s,
            retries=settings.upstream_retries,
            api_key=settings.upstream_api_key,
        )
        return UpstreamClient(config, served_model_name=settings.served_model_name or settings.upstream_model)
    return _builtin_engine(settings)


def _builtin_engine(settings: GatewaySettings) -> EngineClient:
    from ctxgate.backend.engine.async_engine import AsyncEngine  # noqa: I001 (lands with the engine branch)
    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.backend.model.model_prepare import prepare_default_model

    return AsyncEngine(
        EngineConfig(model=str(settings.model or prepare_default_model())),
        max_waiting_requests=settings.engine_max_waiting_requests,
    )


def _tokenizer_for(settings: GatewaySettings, engine: EngineClient) -> Any:
    if settings.tokenizer:  # counting for a remote model: no local model package needed
        from ctxgate.gateway.tokenizer_spec import load_counting_tokenizer

        return load_counting_tokenizer(settings.tokenizer)
    if engine.tokenizer is not None:
        return engine.tokenizer
    from ctxgate.backend.model.model_prepare import resolve_model_path
    from ctxgate.backend.model.tokenizer import load_tokenizer

    # The served model's own tokenizer and chat template: a GGUF file's come from its converted copy.
    return load_tokenizer(str(resolve_model_path(settings.model)))


def default_pipeline(
    tokenizer: Any,
    engine: EngineClient | None,
    index_dir: Any = None,
    settings: GatewaySettings | None = None,
    pacer: TenantCpuShare | None = None,
) -> Pipeline:
    """The compression pipeline over this engine, with its own thread budget (see GatewaySettings)."""
    from ctxgate.compression.pipeline import CompressionPipeline
    from ctxgate.compression.store.cache import set_cache_budget

    settings = settings or GatewaySettings()
    set_cache_budget(settings.compression_cache_mb * 1024 * 1024)  # the process's caches: the last gateway's
    cache = None
    if settings.embed_cache_url:
        from ctxgate.compression.store.redis_cache import RedisBytesCache

        cache = RedisBytesCache(settings.embed_cache_url)
    side_work = engine.side_work if engine is not None and settings.embed_on == "engine" else None
    runner = side_work.run_between_steps if side_work is not None else None
    # The engine serves history summaries at background priority; an HTTP upstream is used the same way.
    return CompressionPipeline(
        tokenizer,
        engine=engine,
        index_dir=index_dir,
        cache=cache,
        workers=settings.compression_workers,
        worker_nice=settings.compression_nice,
        embed_batch_window_ms=settings.embed_batch_window_ms,
        pacer=pacer,
        embed_threads=settings.embed_threads,
        embed_process=runner is None,
        embed_runner=runner,
    )


def _policy_registry(settings: GatewaySettings, metrics: GatewayMetrics) -> PolicyRegistry:
    directories = []
    if settings.include_packaged_policies:
        directories.append(packaged_policy_dir())
    if settings.policy_dir is not None and (
        not directories or settings.policy_dir.resolve() != directories[0].resolve()
    ):
        directories.append(settings.policy_dir)

    def on_failure(error: ReloadError) -> None:
        metrics.policy_reload_failures.labels(error.path).inc()
        metrics.policy_reload_error.labels(error.path).set(1)

    def on_reload(loaded) -> None:
        metrics.policy_reload_error.labels(loaded.path).set(0)

    registry = PolicyRegistry(directories, on_reload_failure=on_failure, on_reload=on_reload)
    metrics.policies_loaded.set(len(registry.names()))
    return registry


def _key_of(gateway: Gateway) -> KeyOf:
    """The request's API key id and tenant share from its headers, as the routes authenticate it (401
    for a bad key)."""

    def key_of(headers: dict[bytes, bytes]) -> Admittee | None:
        def header(name: bytes) -> str | None:
            value = headers.get(name)
            return None if value is None else value.decode("latin-1")

        tenant = gateway.access.authenticate(header(b"authorization"), header(b"x-api-key"))
        if tenant.key is None:
            return None
        return Admittee(key=tenant.key.key_id, tenant=tenant.name, weight=tenant.weight)

    return key_of


def create_app(
    settings: GatewaySettings,
    engine: EngineClient | None = None,
    pipeline: Pipeline | None = None,
    clock: Clock = time.time,
) -> FastAPI:
    """The gateway app. `clock` decides every quota window (and so Retry-After); tests pass their own."""
    metrics = GatewayMetrics()
    owns_engine = engine is None
    if engine is not None and settings.model_list:  # the caller's engine is the list's `engine: builtin`
        from ctxgate.gateway.router_setup import build_router

        engine, owns_engine = build_router(settings, engine, owns_builtin=False), True
    engine = engine if engine is not None else _default_engine(settings)
    tokenizer = _tokenizer_for(settings, engine)
    # One tenant's share of this process's CPU (cpu_share.py): metered at admission and in the workers.
    cpu_share = TenantCpuShare(settings.tenant_cpu_share) if settings.tenant_cpu_share is not None else None
    pipeline = (
        pipeline
        if pipeline is not None
        else default_pipeline(tokenizer, engine, settings.index_dir, settings, pacer=cpu_share)
    )
    admin_key = load_admin_key(settings.admin_key_file) if settings.admin_key_file is not None else None
    gateway = Gateway(
        settings=settings,
        engine=engine,
        tokenizer=tokenizer,
        pipeline=pipeline,
        policies=_policy_registry(settings, metrics),
        keys=KeyStore(settings.keys_file),
        store=create_store(settings.redis_url, clock=clock),
        metrics=metrics,
        admin_key=admin_key,
    )
    app = FastAPI(title="ctxgate", version=package_version("ctxgate"), lifespan=lifespan)
    app.state.gateway = gateway
    app.state.owns_engine = owns_engine
    app.state.embedder_load = None  # set by the lifespan while the embedding model loads
    install_error_handlers(app)
    add_routes(app)
    document_request_bodies(app, REQUEST_BODIES, ERROR_ANSWERS)
    app.state.admission = AdmissionController(
        settings.max_in_flight,
        settings.max_queued,
        settings.queue_timeout_s,
        max_queued_per_key=settings.max_queued_per_key,
    )
    app.state.cpu_share = cpu_share
    app.add_middleware(
        AdmissionControl,
        controller=app.state.admission,
        key_of=_key_of(gateway),
        max_open_per_key=settings.max_open_per_key,
        cpu_share=app.state.cpu_share,
    )
    # Outside admission: a body over the limit or too slow is cut off before it could be admitted.
    app.add_middleware(
        BodySizeLimit, max_body_bytes=settings.max_body_bytes, read_timeout_s=settings.body_read_timeout_s
    )
    app.add_middleware(RequestCounter, metrics=metrics)
    app.add_middleware(RequestId, access_log=settings.access_log)  # outermost: every answer carries the id
    metrics.registry.register(AdmissionCollector(app.state.admission, app.state.cpu_share))
    # The console exists only with an admin key: otherwise none of its routes does (404). Mounted
    # last, so its security headers wrap every /console answer, the middlewares' own included.
    app.state.console = (
        install_console(app, admin_key, metrics, clock, settings.metrics_key)
        if admin_key is not None
        else None
    )
    return app
