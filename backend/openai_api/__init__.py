"""The OpenAI wire protocol, written once for both HTTP servers.

`ctxgate.backend.serving.server` (the engine's own server) and `ctxgate.gateway.app` (the prompt-budget gateway) import
everything they say on the wire from here, so the two cannot drift:

- `schemas`: request bodies (`ChatCompletionRequest`, `CompletionRequest`) and message flattening;
- `responses`: response bodies, stream chunks and the `usage` payload;
- `errors`: `APIError`, the `{"error": {...}}` shape, status-to-type mapping, exception handlers;
- `sse`: server-sent-event framing (writing and reading);
- `http`: strict JSON body parsing, the body-size limit, client-disconnect handling, OpenAPI bodies.

It lives in `backend` because the gateway may import the backend but never the other way round.
"""
