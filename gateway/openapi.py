"""Request bodies in the gateway's OpenAPI document.

The generation routes parse their JSON by hand (to answer malformed input with OpenAI-style 400s),
so FastAPI cannot see their body models; this adds them, and the error answers, to `/openapi.json`
so clients, generators and schema-driven fuzzers (schemathesis) know what to send.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from gateway.schemas import ChatCompletionRequest, CompletionRequest

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


def document_request_bodies(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in REQUEST_BODIES.items():
            operation = schema["paths"].get(path, {}).get("post")
            if operation is None:
                continue
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            for status, description in ERROR_ANSWERS.items():
                operation["responses"].setdefault(status, {"description": description})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
