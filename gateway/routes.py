"""The gateway's HTTP routes: OpenAI's generation endpoints, ctxgate's own, health and metrics.

Every route that touches tenant data authenticates first; a key sees only what its tenant may use.
"""

from __future__ import annotations

import hmac
import os
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ctxgate.backend.engine.api import GenerationRequest
from ctxgate.backend.openai_api.errors import APIError
from ctxgate.backend.openai_api.http import parse_body, parse_body_and_json
from ctxgate.backend.openai_api.request_params import OutputOptions
from ctxgate.backend.openai_api.responses import ResponseWriter
from ctxgate.gateway.generation import Generation, complete, stream
from ctxgate.gateway.keys import Tenant
from ctxgate.gateway.prepared import Prepared, compression_figures, rate_limit_headers
from ctxgate.gateway.schemas import ChatCompletionRequest, CompletionRequest, GatewayRequest
from ctxgate.gateway.segments import prompt_segments
from ctxgate.gateway.service import Gateway
from ctxgate.gateway.shadow.ledger import shadow_summary
from ctxgate.policies.loader import ReloadError

if TYPE_CHECKING:
    from ctxgate.gateway.lifecycle import EmbedderLoad


def add_routes(app: FastAPI) -> None:
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"])
    app.add_api_route("/metrics", prometheus_metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/ctxgate/policies", policies, methods=["GET"])
    app.add_api_route("/v1/ctxgate/compress", compress, methods=["POST"])
    app.add_api_route("/v1/ctxgate/shadow", shadow, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _tenant(request: Request) -> Tenant:
    return _gateway(request).access.authenticate(
        request.headers.get("authorization"), request.headers.get("x-api-key")
    )


async def health() -> dict[str, str]:
    return {"status": "ok"}


async def ready(request: Request) -> JSONResponse:
    gateway = _gateway(request)
    engine_ready = gateway.engine.is_ready() and not request.app.state.admission.draining
    store_ready = await gateway.store.ping()
    gateway.metrics.quota_store_up.set(1 if store_ready else 0)
    # Until the compression embedder is loaded, every compressing request would wait for it.
    embedder_load: EmbedderLoad | None = request.app.state.embedder_load
    embedder_ready = embedder_load is not None and embedder_load.is_loaded()
    ready = engine_ready and store_ready and embedder_ready
    body = {
        "status": "ready" if ready else "not ready",
        "engine": engine_ready,
        "store": store_ready,
        "store_kind": gateway.store.name,
        "embedder": embedder_ready,
    }
    return JSONResponse(body, status_code=200 if ready else 503)


async def prometheus_metrics(request: Request) -> Response:
    gateway = _gateway(request)
    _check_metrics_key(gateway.settings.metrics_key, request.headers.get("authorization"))
    payload = generate_latest(gateway.metrics.registry)
    engine_registry = gateway.engine.metrics_registry
    if engine_registry is not None:
        payload += generate_latest(engine_registry)
    return Response(payload, media_type=CONTENT_TYPE_LATEST)


def _check_metrics_key(expected: str | None, authorization: str | None) -> None:
    """With a metrics key set, /metrics (tenant names, spend, upstream health) needs it as a Bearer
    token; compared in constant time."""
    if expected is None:
        return
    given = (authorization or "").encode()
    if not hmac.compare_digest(given, f"Bearer {expected}".encode()):
        message = "/metrics needs the metrics key (Authorization: Bearer <key>)"
        raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def models(request: Request) -> dict[str, Any]:
    tenant = _tenant(request)
    gateway = _gateway(request)
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "ctxgate",
                "max_model_len": gateway.access.engine_for(name).max_model_len,
                "engine_path": gateway.access.engine_for(name).path_info,
            }
            for name in gateway.access.allowed_models(tenant)
        ],
    }


async def policies(request: Request) -> dict[str, Any]:
    """The policies the caller may name, as they apply. A key sees only its own (no reload errors:
    those are about files, the operator's business); open mode lists every policy and error. File
    names only, never the server's directories."""
    tenant = _tenant(request)
    gateway = _gateway(request)
    allowed = gateway.access.allowed_policies(tenant)
    listed = [item for item in gateway.policies.loaded() if allowed is None or item.policy.name in allowed]
    body: dict[str, Any] = {
        "default": gateway.access.home_policy_name(tenant),
        "policies": [
            {
                "name": item.policy.name,
                "loaded_at": item.loaded_at,
                "effective": gateway.resolver.fit_to_model(item.policy).model_dump(mode="json"),
            }
            | ({} if tenant.bounded else {"file": os.path.basename(item.path)})
            for item in listed
        ],
    }
    if not tenant.bounded:
        errors = [_reload_error(err, gateway.policies.directories) for err in gateway.policies.errors()]
        body |= {"errors": errors, "last_reload_error": errors[-1] if errors else None}
    return body


def _reload_error(error: ReloadError, directories: list[Any]) -> dict[str, Any]:
    # The loader's messages name files by their full paths: show file names instead.
    message = error.message
    for directory in directories:
        message = message.replace(f"{directory}{os.sep}", "")
    return {"file": os.path.basename(error.path), "message": message, "at": error.at}


async def shadow(request: Request) -> dict[str, Any]:
    """The shadow comparisons' summary: a tenant's key sees its own tenant's only; the metrics key
    (the operator) and an open gateway see every tenant's."""
    gateway = _gateway(request)
    expected = gateway.settings.metrics_key
    given = (request.headers.get("authorization") or "").encode()
    if expected is not None and hmac.compare_digest(given, f"Bearer {expected}".encode()):
        return shadow_summary(gateway.shadow_ledger, None).as_dict()
    tenant = _tenant(request)
    return shadow_summary(gateway.shadow_ledger, tenant.name if tenant.bounded else None).as_dict()


async def compress(request: Request, response: Response) -> dict[str, Any]:
    tenant = _tenant(request)
    gateway = _gateway(request)
    body = await parse_body(request, ChatCompletionRequest)
    compressed = await gateway.preparation.compress(body, tenant)
    response.headers.update(rate_limit_headers(compressed.rate_limits))
    result = compressed.result
    return {
        "messages": result.messages,
        "policy": compressed.policy.name,
        "report": {
            **compression_figures(result),
            "segments": prompt_segments(result),
            **({"fit": compressed.fit.report()} if compressed.fit is not None else {}),
            "stages": [
                {"name": s.name, "saved_tokens": s.saved_tokens, "ms": round(s.ms, 3), "details": s.details}
                for s in result.stages
            ],
        },
    }


async def chat_completions(request: Request) -> Response:
    tenant = _tenant(request)
    body, raw = await parse_body_and_json(request, ChatCompletionRequest)
    prepared = await _gateway(request).preparation.chat(body, tenant, raw)
    return await _answer(request, body, prepared, messages=prepared.result.messages)


async def completions(request: Request) -> Response:
    tenant = _tenant(request)
    body, raw = await parse_body_and_json(request, CompletionRequest)
    prepared = await _gateway(request).preparation.completion(body, tenant, raw)
    return await _answer(request, body, prepared, messages=None)


async def _answer(
    request: Request, body: GatewayRequest, prepared: Prepared, messages: list[dict[str, Any]] | None
) -> Response:
    """Run the prepared request on the engine and answer whole or streamed, as the client asked."""
    gateway = _gateway(request)
    generation = GenerationRequest(
        request_id=prepared.request_id,
        prompt_token_ids=prepared.prompt_token_ids,
        sampling=prepared.sampling,
        priority=prepared.priority,
        cache_salt=gateway.access.cache_salt(prepared.tenant.name),
        messages=messages,
        prompt_text=prepared.prompt_text,
        forward=prepared.forward,
        model=body.model,
        route_key=prepared.route_key,
        allowed_models=frozenset(gateway.access.allowed_models(prepared.tenant)),
        tenant=prepared.tenant.name,
        weight=prepared.tenant.weight,
    )
    writer = ResponseWriter(
        prepared.request_id,
        body.model,
        prepared.created,
        chat=isinstance(body, ChatCompletionRequest),
        output=prepared.asks.output if prepared.asks else OutputOptions(),
    )
    run = Generation(gateway.generation_services, prepared, generation)
    if body.stream:
        response = await stream(request, run, writer, request.url.path, body.usage_wanted(), prepared.choices)
    else:
        response = await complete(request, run, writer)
    # Known since the reservation: a stream's headers can carry them before its first token.
    reservation = prepared.reservation
    response.headers.update(rate_limit_headers(reservation.rate_limits if reservation is not None else None))
    return response
