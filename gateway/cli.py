"""`ctxgate serve`, `ctxgate policy check|schema` and `ctxgate keys add` (import-light)."""

from __future__ import annotations

import argparse
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible budget gateway")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--served-model-name", default=None, help="the name clients send as 'model'")
    serve.add_argument("--policy-dir", default=None,
                       help="directory of policy YAML files, watched for edits (packaged policies stay available)")
    serve.add_argument("--default-policy", default="rag-default", help="policy when none is named")
    serve.add_argument("--index-dir", default=None,
                       help="retrieval indexes built by `ctxgate index build` (default $CTXGATE_INDEX_DIR)")
    serve.add_argument("--keys", default=None, help="keys file (YAML); without it the gateway is open")
    serve.add_argument("--upstream", action="append", default=[], metavar="URL",
                       help="OpenAI-compatible upstream instead of the in-process engine (repeat to fail over)")
    serve.add_argument("--upstream-model", default=None, help="model name to send upstream (default: discovered)")
    serve.add_argument("--upstream-connect-timeout", type=float, default=2.0)
    serve.add_argument("--upstream-read-timeout", type=float, default=120.0)
    serve.add_argument("--upstream-retries", type=int, default=1)
    serve.add_argument("--upstream-api-key", default=os.environ.get("CTXGATE_UPSTREAM_API_KEY"),
                       help="Bearer key sent to the upstream (default $CTXGATE_UPSTREAM_API_KEY)")
    serve.add_argument("--tokenizer", default=None,
                       help="count budgets with this: a local HF tokenizer dir or a tiktoken encoding name "
                       "(for a remote model; no local model is needed then)")
    serve.add_argument("--drop-params", action="store_true",
                       help="drop request fields the built-in engine cannot honour instead of answering 400")
    serve.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                       help="shared quota store (default: $REDIS_URL; in-process when unset)")
    serve.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    serve.add_argument("--reload-interval", type=float, default=1.0, help="seconds between policy file checks")
    serve.add_argument("--max-in-flight", type=int, default=64,
                       help="generation requests running at once; 0 for no limit (default 64)")
    serve.add_argument("--max-queued", type=int, default=64, help="requests waiting for a slot before 503s")
    serve.add_argument("--queue-timeout", type=float, default=10.0, help="seconds a request may wait for a slot")
    serve.add_argument("--request-timeout", type=float, default=300.0,
                       help="seconds an admitted request may take; 0 for no limit (default 300)")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds to let in-flight requests finish (new ones get 503)")
    serve.add_argument("--max-waiting-requests", type=int, default=256,
                       help="in-process engine: refuse new requests with 503 beyond this many waiting (default 256)")
    _add_engine_arguments(serve)  # --model and the in-process engine's knobs, as in `engine serve`
    serve.set_defaults(func=_serve)

    policy = subparsers.add_parser("policy", help="validate policies and print their schema")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    check = policy_sub.add_parser("check", help="validate policy YAML files")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.set_defaults(func=_policy_check)
    schema = policy_sub.add_parser("schema", help="print the policy JSON Schema")
    schema.set_defaults(func=_policy_schema)

    keys = subparsers.add_parser("keys", help="manage API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    add = keys_sub.add_parser("add", help="create a key for a tenant; prints it once, stores only its hash")
    add.add_argument("tenant")
    add.add_argument("--keys", default="keys.yaml", help="keys file (default keys.yaml)")
    add.add_argument("--policy", default=None, help="the tenant's policy")
    add.add_argument("--label", default=None, help="a note stored with the hash")
    add.set_defaults(func=_keys_add)


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    try:
        from backend.cli import add_engine_arguments
    except ImportError:  # an engine package without the shared flags: the model dir is enough
        parser.add_argument("--model", default=None, help="Hugging Face model dir (default: SmolLM2-135M)")
        return
    add_engine_arguments(parser)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    settings = GatewaySettings(
        host=args.host, port=args.port, model=args.model, served_model_name=args.served_model_name,
        policy_dir=args.policy_dir, keys_file=args.keys, index_dir=args.index_dir, upstreams=args.upstream,
        upstream_model=args.upstream_model, upstream_connect_timeout_s=args.upstream_connect_timeout,
        upstream_read_timeout_s=args.upstream_read_timeout, upstream_retries=args.upstream_retries,
        upstream_api_key=args.upstream_api_key or None, tokenizer=args.tokenizer, drop_params=args.drop_params,
        redis_url=args.redis_url or None, default_policy=args.default_policy,
        max_body_bytes=args.max_body_bytes, reload_interval_s=args.reload_interval,
        max_in_flight=args.max_in_flight or None, max_queued=args.max_queued, queue_timeout_s=args.queue_timeout,
        request_timeout_s=args.request_timeout or None, engine_max_waiting_requests=args.max_waiting_requests,
        drain_timeout_s=args.drain_timeout,
    )
    from gateway.shutdown import DrainingServer

    engine = None
    if not settings.upstreams and hasattr(args, "dtype"):
        from backend.async_engine import AsyncEngine
        from backend.cli import engine_config_from_args

        engine = AsyncEngine(engine_config_from_args(args), max_waiting_requests=args.max_waiting_requests)
    app = create_app(settings, engine=engine)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=5)
    try:
        # SIGTERM drains: new requests get 503, in-flight ones finish (bounded by --drain-timeout).
        DrainingServer(config, app.state.admission, settings.drain_timeout_s).run()
    finally:
        if engine is not None:
            engine.shutdown()
    return 0


def _policy_check(args: argparse.Namespace) -> int:
    from policies.loader import PolicyFileError, load_policy_file

    failed = 0
    for path in args.files:
        try:
            policy = load_policy_file(path)
        except PolicyFileError as exc:
            print(exc, file=sys.stderr)
            failed += 1
            continue
        print(f"{path}: ok (policy '{policy.name}', max_input_tokens={policy.max_input_tokens})")
    return 1 if failed else 0


def _policy_schema(_args: argparse.Namespace) -> int:
    import json

    from policies.schema import Policy

    print(json.dumps(Policy.model_json_schema(), indent=2))
    return 0


def _keys_add(args: argparse.Namespace) -> int:
    from gateway.keys import add_key

    key = add_key(args.keys, args.tenant, policy=args.policy, label=args.label)
    print(key)
    print(f"stored the sha256 of this key for tenant '{args.tenant}' in {args.keys}; it is not shown again",
          file=sys.stderr)
    return 0
