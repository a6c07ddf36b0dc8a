"""`ctxgate serve`, `ctxgate config check|schema`, `ctxgate policy check|schema`, `ctxgate keys ...` (import-light)."""

from __future__ import annotations

import argparse
import os
import sys

from backend.cli_actions import DeprecatedOption, at_least_one, nice_increment
from gateway.config_file import defer_defaults, exclusive_groups
from gateway.settings import DEFAULT_COMPRESSION_NICE


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible budget gateway")
    serve.add_argument("--config", default=None, metavar="FILE",
                       help="YAML config file (see `ctxgate config schema`); flags given here override it")
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
    serve.add_argument("--upstream-model", default=None, action=DeprecatedOption, replacement="--served-model-name",
                       help="deprecated: use --served-model-name (the upstream's own name is discovered from its "
                       "/v1/models; upstreams.model in the config file overrides that)")
    serve.add_argument("--upstream-connect-timeout", type=float, default=2.0,
                       help="seconds to connect to an upstream before trying the next (default 2)")
    serve.add_argument("--upstream-read-timeout", type=float, default=120.0,
                       help="seconds an upstream may stay silent mid-response before the request fails (default 120)")
    serve.add_argument("--upstream-retries", type=int, default=1,
                       help="extra connection attempts per upstream URL before failing over (default 1)")
    serve.add_argument("--upstream-api-key", default=os.environ.get("CTXGATE_UPSTREAM_API_KEY"),
                       help="Bearer key sent to the upstream (default $CTXGATE_UPSTREAM_API_KEY)")
    serve.add_argument("--tokenizer", default=None,
                       help="count budgets with this: a local HF tokenizer dir or a tiktoken encoding name "
                       "(for a remote model; no local model is needed then)")
    serve.add_argument("--drop-params", action="store_true",
                       help="drop request fields the built-in engine cannot honour instead of answering 400")
    serve.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                       help="shared quota store (default: $REDIS_URL; in-process when unset)")
    serve.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024,
                       help="larger request bodies are refused with 413 before being read (default 8 MiB)")
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
    serve.add_argument("--allow-unauthenticated", action="store_true",
                       help="serve on a non-loopback --host without --keys (only behind a proxy that authenticates)")
    serve.add_argument("--metrics-key", default=os.environ.get("CTXGATE_METRICS_KEY"),
                       help="Bearer token /metrics requires (default $CTXGATE_METRICS_KEY; unset: /metrics is open)")
    serve.add_argument("--body-read-timeout", type=float, default=30.0,
                       help="seconds a client may take to send its request body; slower ones get 408 (default 30)")
    serve.add_argument("--access-log", action="store_true",
                       help="log one line per request (method, path, status, duration, request id, tenant)")
    serve.add_argument("--embed-on", choices=("engine", "process"), default="engine",
                       help="where the compression embedder's forward passes run: on the in-process CPU engine's "
                       "thread between its steps (default), or in a child process of their own")
    serve.add_argument("--compression-workers", type=at_least_one, default=None, metavar="N",
                       help="threads that compress requests, off the event loop (default: one per two cores)")
    serve.add_argument("--compression-nice", type=nice_increment, default=None, metavar="N",
                       help="run the compression workers N steps below the engine's CPU priority, 0-19 "
                       f"(Linux nice; default {DEFAULT_COMPRESSION_NICE}): they yield the cores to the engine")
    serve.add_argument("--vllm-metric-names", action="store_true",
                       help="also export the in-process engine's metrics under vLLM's names (vllm:...)")
    _add_engine_arguments(serve)  # --model and the in-process engine's knobs, as in `engine serve`
    # Defaults are applied after parsing, below the config file: only flags really given override it.
    serve.set_defaults(func=_serve, flag_defaults=defer_defaults(serve), flag_exclusive=exclusive_groups(serve))

    config = subparsers.add_parser("config", help="validate a `serve --config` file and print its schema")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    config_check = config_sub.add_parser("check", help="validate config files (environment references included)")
    config_check.add_argument("files", nargs="+", metavar="FILE", help="config files to validate")
    config_check.set_defaults(func=_config_check)
    config_schema = config_sub.add_parser("schema", help="print the config file's JSON Schema")
    config_schema.set_defaults(func=_config_schema)

    policy = subparsers.add_parser("policy", help="validate policies and print their schema")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    check = policy_sub.add_parser("check", help="validate policy YAML files")
    check.add_argument("files", nargs="+", metavar="FILE", help="policy YAML files to validate")
    check.set_defaults(func=_policy_check)
    schema = policy_sub.add_parser("schema", help="print the policy JSON Schema")
    schema.set_defaults(func=_policy_schema)

    _register_keys(subparsers)


def _register_keys(subparsers: argparse._SubParsersAction) -> None:
    keys = subparsers.add_parser("keys", help="manage API keys: add, list, revoke, rotate")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    keys_file_help = "keys file (default keys.yaml)"
    add = keys_sub.add_parser("add", help="create a key for a tenant; prints it once, stores only its hash")
    add.add_argument("tenant", help="tenant the key belongs to (created if new)")
    add.add_argument("--keys", default="keys.yaml", help=keys_file_help)
    add.add_argument("--policy", default=None, help="the tenant's home policy (its quota and prices)")
    add.add_argument("--allow-policy", action="append", default=None, dest="allow_policies", metavar="NAME",
                     help="another policy the tenant's requests may name (repeat; default: the home policy only)")
    add.add_argument("--allow-index", action="append", default=None, dest="allow_indexes", metavar="NAME",
                     help="a retrieval index the tenant may search (repeat; default: none)")
    add.add_argument("--label", action="append", default=[], metavar="NAME=VALUE",
                     help="a searchable label (repeat); text without '=' is stored as a free-text note")
    add.add_argument("--expires", default=None, metavar="WHEN",
                     help="expiry: a duration from now (90d, 12h, 30m) or an ISO date/time (UTC unless zoned)")
    add.add_argument("--model", action="append", default=None, dest="models", metavar="NAME",
                     help="served model name this key may use (repeat); default: every model")
    add.add_argument("--requests-per-minute", type=int, default=None, help="per-key request limit per minute")
    add.add_argument("--tokens-per-minute", type=int, default=None,
                     help="per-key limit on prompt + reserved output tokens per minute")
    add.add_argument("--max-parallel-requests", type=int, default=None,
                     help="per-key limit on generation requests in flight at once")
    add.add_argument("--budget", type=float, default=None,
                     help="per-key spend allowed per --budget-period, in the policy's cost units")
    add.add_argument("--budget-period", choices=["daily", "weekly", "monthly"], default=None,
                     help="window of --budget, aligned to UTC day / ISO week / calendar month (default monthly)")
    add.set_defaults(func=_keys_add)

    listing = keys_sub.add_parser("list", help="list keys (ids, tenants, status, limits, labels; never the keys)")
    listing.add_argument("--keys", default="keys.yaml", help=keys_file_help)
    listing.add_argument("--tenant", default=None, help="only this tenant's keys")
    listing.add_argument("--label", action="append", default=[], metavar="NAME=VALUE",
                         help="only keys carrying this label (repeat: all must match)")
    listing.add_argument("--all", action="store_true", help="include revoked and expired keys")
    listing.add_argument("--json", action="store_true", help="one JSON object per key instead of a table")
    listing.set_defaults(func=_keys_list)

    revoke = keys_sub.add_parser("revoke", help="revoke keys; running gateways refuse them after their next reload")
    revoke.add_argument("key_ids", nargs="+", metavar="KEY_ID", help="key id from `keys list` (or the key itself)")
    revoke.add_argument("--keys", default="keys.yaml", help=keys_file_help)
    revoke.set_defaults(func=_keys_revoke)

    rotate = keys_sub.add_parser("rotate", help="replace a key with a new one (same tenant, limits and counters)")
    rotate.add_argument("key_id", metavar="KEY_ID", help="key id from `keys list` (or the key itself)")
    rotate.add_argument("--keys", default="keys.yaml", help=keys_file_help)
    rotate.add_argument("--grace", default=None, metavar="DURATION",
                        help="keep the old key valid this long (e.g. 1h) instead of revoking it now")
    rotate.set_defaults(func=_keys_rotate)


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    try:
        from backend.cli import add_engine_arguments
    except ImportError:  # an engine package without the shared flags: the model dir is enough
        parser.add_argument("--model", default=None, help="Hugging Face model dir (default: SmolLM2-135M)")
        return
    add_engine_arguments(parser)


def resolve_serve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Layer command line > config file > defaults into `args` (in place) and return it."""
    import logging

    from gateway.config_file import layer, load_config

    path = getattr(args, "config", None)
    file_values = load_config(path).flag_values() if path else {}
    layer(args, args.flag_defaults, file_values, args.flag_exclusive)
    if not getattr(args, "log_level_given", False) and "log_level" in file_values:
        args.log_level = file_values["log_level"]
        logging.getLogger().setLevel(args.log_level)
    return args


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    resolve_serve_args(args)

    from gateway.app import create_app
    from gateway.settings import GatewaySettings, exposure_problem

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
        drain_timeout_s=args.drain_timeout, access_log=args.access_log, embed_on=args.embed_on,
        allow_unauthenticated=args.allow_unauthenticated, metrics_key=args.metrics_key or None,
        body_read_timeout_s=args.body_read_timeout,
        **({"compression_workers": args.compression_workers} if args.compression_workers is not None else {}),
        **({"compression_nice": args.compression_nice} if args.compression_nice is not None else {}),
    )
    problem = exposure_problem(settings)
    if problem is not None:
        print(f"ctxgate serve: {problem}", file=sys.stderr)
        return 2
    _log_request_ids()
    from gateway.shutdown import DrainingServer

    engine = None
    if not settings.upstreams and hasattr(args, "dtype"):
        from backend.async_engine import AsyncEngine
        from backend.cli import engine_config_from_args

        engine = AsyncEngine(engine_config_from_args(args), max_waiting_requests=args.max_waiting_requests)
        if args.vllm_metric_names:
            from backend.metrics import export_vllm_names

            export_vllm_names(engine.metrics)
    app = create_app(settings, engine=engine)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=5)
    try:
        # SIGTERM drains: new requests get 503, in-flight ones finish (bounded by --drain-timeout).
        DrainingServer(config, app.state.admission, settings.drain_timeout_s).run()
    finally:
        if engine is not None:
            engine.shutdown()
    from gateway.lifecycle import exit_if_still_loading

    exit_if_still_loading(app)
    return 0


def _log_request_ids() -> None:
    """Every log line written while serving a request names its x-request-id."""
    import logging

    from gateway.request_id import RequestIdFilter

    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))


def _config_check(args: argparse.Namespace) -> int:
    from gateway.config_file import ConfigError, load_config
    from gateway.keys import read_keys_file

    failed = 0
    for path in args.files:
        try:
            config = load_config(path)
            if config.keys_file is not None and os.path.exists(config.keys_file):
                read_keys_file(config.keys_file)  # a broken keys file would stop `serve` too
            for name, value in (("keys_file", config.keys_file), ("policy_dir", config.policy_dir)):
                if value is not None and not os.path.exists(value):
                    raise ConfigError(f"{path}: field '{name}': {value} does not exist")
        except ValueError as exc:
            print(exc, file=sys.stderr)
            failed += 1
            continue
        print(f"{path}: ok")
    return 1 if failed else 0


def _config_schema(_args: argparse.Namespace) -> int:
    import json

    from gateway.config_file import config_schema

    print(json.dumps(config_schema(), indent=2))
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


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds in '90d', '12h', '30m', '45s' or '2w'."""
    number, unit = text[:-1], text[-1:].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _DURATION_UNITS or value <= 0:
        raise ValueError(f"'{text}' is not a duration (use e.g. 90d, 12h, 30m, 45s, 2w)")
    return value * _DURATION_UNITS[unit]


def parse_when(text: str):
    """A duration from now or an ISO date/time (UTC unless it names a zone)."""
    from datetime import UTC, datetime, timedelta

    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        try:
            return datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=parse_duration(text))
        except ValueError:
            raise ValueError(f"--expires: '{text}' is neither a duration (90d, 12h) nor an ISO date/time") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _parse_labels(items: list[str]) -> tuple[dict[str, str], str | None]:
    labels, notes = {}, []
    for item in items:
        name, sep, value = item.partition("=")
        if sep and name.strip():
            labels[name.strip()] = value.strip()
        else:
            notes.append(item)
    return labels, "; ".join(notes) or None


def _keys_add(args: argparse.Namespace) -> int:
    from gateway.keys import Limits, add_key

    labels, note = _parse_labels(args.label)
    limits = Limits(
        requests_per_minute=args.requests_per_minute, tokens_per_minute=args.tokens_per_minute,
        max_parallel_requests=args.max_parallel_requests, budget=args.budget, budget_period=args.budget_period,
    )
    if args.budget_period and args.budget is None:
        raise ValueError("--budget-period needs --budget")
    expires_at = parse_when(args.expires) if args.expires else None
    key = add_key(args.keys, args.tenant, policy=args.policy, label=note, labels=labels, expires_at=expires_at,
                  limits=limits, models=args.models, policies=args.allow_policies, indexes=args.allow_indexes)
    print(key)
    print(f"stored the sha256 of this key for tenant '{args.tenant}' in {args.keys}; it is not shown again",
          file=sys.stderr)
    return 0


def _keys_list(args: argparse.Namespace) -> int:
    import json
    from datetime import UTC, datetime

    from gateway.keys import read_keys_file

    if not os.path.exists(args.keys):
        raise FileNotFoundError(f"keys file not found: {args.keys}")
    wanted, _ = _parse_labels(args.label)
    now = datetime.now(UTC)
    rows = []
    for tenant, entry in read_keys_file(args.keys).tenants.items():
        if args.tenant is not None and tenant != args.tenant:
            continue
        for key in entry.keys:
            status = key.status(now)
            if (status != "active" and not args.all) or any(key.labels.get(k) != v for k, v in wanted.items()):
                continue
            rows.append({
                "id": key.key_id, "tenant": tenant, "status": status, "created": key.created,
                "expires_at": key.expires_at.isoformat() if key.expires_at else None,
                "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
                "models": key.models, "limits": key.limits.model_dump(exclude_none=True),
                "labels": key.labels, "note": key.label,
            })
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"{'ID':<13} {'TENANT':<16} {'STATUS':<8} {'EXPIRES':<26} {'MODELS':<20} LIMITS / LABELS")
    for row in rows:
        extras = [f"{k}={v}" for k, v in row["limits"].items()] + [f"{k}={v}" for k, v in row["labels"].items()]
        print(f"{row['id']:<13} {row['tenant']:<16} {row['status']:<8} {row['expires_at'] or '-':<26} "
              f"{','.join(row['models'] or ['*']):<20} {' '.join(extras) or '-'}")
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    from gateway.keys import revoke_key

    for key_id in args.key_ids:
        tenant, entry = revoke_key(args.keys, key_id)
        print(f"revoked {entry.key_id} (tenant '{tenant}') at {entry.revoked_at.isoformat()}")
    return 0


def _keys_rotate(args: argparse.Namespace) -> int:
    from gateway.keys import rotate_key

    grace = parse_duration(args.grace) if args.grace else 0.0
    tenant, key, old = rotate_key(args.keys, args.key_id, grace_s=grace)
    print(key)
    ending = f"expires at {old.expires_at.isoformat()}" if grace else "is revoked"
    print(f"new key for tenant '{tenant}' stored in {args.keys}; the old key {old.key_id} {ending}", file=sys.stderr)
    return 0
