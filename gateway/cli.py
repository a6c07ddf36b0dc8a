"""`ctxgate serve`, `ctxgate config check|schema`, `ctxgate policy check|schema`, `ctxgate keys ...` (import-light)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from pydantic import ValidationError

from ctxgate.backend.engine.config import EngineConfig
from ctxgate.backend.settings.flags import (
    add_model_flags,
    describe_errors,
    given_values,
    kebab,
    static_defaults,
)
from ctxgate.gateway.config_file import SERVER_SKIP
from ctxgate.gateway.settings import GatewaySettings


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible budget gateway")
    serve.add_argument("--config", default=None, metavar="FILE",
                       help="YAML config file (see `ctxgate config schema`); flags given here override it")
    # Every other flag is a settings field (gateway/settings.py, backend/engine/config.py), with no argparse
    # default: what is not given comes from the config file, then from the field's default.
    add_model_flags(serve, GatewaySettings, skip=SERVER_SKIP)
    add_model_flags(serve, EngineConfig)  # --model and the in-process engine's knobs, as in `engine serve`
    # For the reference docs: the defaults that apply when neither a flag nor the file sets a value.
    serve.set_defaults(func=_serve, flag_defaults={**static_defaults(GatewaySettings, SERVER_SKIP),
                                                   **static_defaults(EngineConfig)})

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


@dataclass
class ServeConfig:
    """What `ctxgate serve` runs with, once flags, the config file and defaults are layered."""

    settings: GatewaySettings
    engine: EngineConfig
    log_level: str


def resolve_serve_args(args: argparse.Namespace) -> ServeConfig:
    """Layer command line > config file > environment > defaults into the settings models.

    Sets the logging level from the file unless --log-level was given. A problem names the flag
    and the config key of the setting.
    """
    import logging

    from ctxgate.gateway.config_file import CtxgateConfig, load_config

    path = getattr(args, "config", None)
    config = load_config(path) if path else CtxgateConfig()
    server = {**config.server_values(), **given_values(args, GatewaySettings, SERVER_SKIP)}
    flags = given_values(args, EngineConfig)
    engine = config.engine_values()
    for group in EngineConfig.EXCLUSIVE:  # a flag of the group replaces the file's choice among them
        if any(name in flags for name in group):
            for name in group:
                engine.pop(name, None)
    engine.update(flags)
    problems: list[str] = []
    settings = engine_config = None
    try:
        settings = GatewaySettings(**server, model=engine.get("model"), model_list=config.model_list)
    except ValidationError as exc:
        problems += describe_errors(exc, lambda name: f"{kebab(name)} (server.{name})", "server")
    try:
        engine_config = EngineConfig(**engine)
    except ValidationError as exc:
        problems += describe_errors(exc, lambda name: f"{kebab(name)} (engine.{name})", "engine")
    if problems:
        raise ValueError("; ".join(problems))
    log_level = args.log_level
    if not getattr(args, "log_level_given", False) and config.logging.level is not None:
        log_level = args.log_level = config.logging.level
        logging.getLogger().setLevel(log_level)
    return ServeConfig(settings, engine_config, log_level)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    resolved = resolve_serve_args(args)
    settings = resolved.settings

    from ctxgate.gateway.app import create_app
    from ctxgate.gateway.settings import exposure_problem

    problem = exposure_problem(settings)
    if problem is not None:
        print(f"ctxgate serve: {problem}", file=sys.stderr)
        return 2
    _log_request_ids()
    from ctxgate.gateway.model_list_config import builtin_needed
    from ctxgate.gateway.shutdown import DrainingServer

    engine = None
    if builtin_needed(settings.model_list, settings.upstreams):
        from ctxgate.backend.engine.async_engine import AsyncEngine

        engine = AsyncEngine(resolved.engine, max_waiting_requests=settings.engine_max_waiting_requests)
        if settings.vllm_metric_names:
            from ctxgate.backend.engine.metrics import export_vllm_names

            export_vllm_names(engine.metrics)
    app = create_app(settings, engine=engine)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=resolved.log_level.lower(),
                            access_log=False, timeout_graceful_shutdown=5)
    try:
        # SIGTERM drains: new requests get 503, in-flight ones finish (bounded by drain_timeout_s).
        DrainingServer(config, app.state.admission, settings.drain_timeout_s).run()
    finally:
        if engine is not None:
            engine.shutdown()
    from ctxgate.gateway.lifecycle import exit_if_still_loading

    exit_if_still_loading(app)
    return 0


def _log_request_ids() -> None:
    """Every log line written while serving a request names its x-request-id."""
    import logging

    from ctxgate.gateway.request_id import RequestIdFilter

    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))


def _config_check(args: argparse.Namespace) -> int:
    """Every problem of every file (not just the first), one line each; status 1 if any."""
    from ctxgate.gateway.config_file import ConfigError, load_config

    failed = 0
    for path in args.files:
        try:
            config = load_config(path)
            problems = _file_references_problems(config)
        except ConfigError as exc:
            problems = exc.problems
        if problems:
            print(ConfigError(path, problems), file=sys.stderr)
            failed += 1
            continue
        print(f"{path}: ok")
    return 1 if failed else 0


def _file_references_problems(config) -> list[str]:
    """The files a config names: they exist, and a keys file parses (a broken one would stop `serve` too)."""
    from ctxgate.gateway.keys import read_keys_file

    problems = []
    for name in ("keys_file", "policy_dir"):
        value = getattr(config.server, name)
        if value is not None and not os.path.exists(value):
            problems.append(f"field 'server.{name}': {value} does not exist")
    keys_file = config.server.keys_file
    if keys_file is not None and os.path.exists(keys_file):
        try:
            read_keys_file(keys_file)
        except ValueError as exc:
            problems.append(f"field 'server.keys_file': {exc}")
    return problems


def _config_schema(_args: argparse.Namespace) -> int:
    import json

    from ctxgate.gateway.config_file import config_schema

    print(json.dumps(config_schema(), indent=2))
    return 0


def _policy_check(args: argparse.Namespace) -> int:
    from ctxgate.policies.loader import PolicyFileError, load_policy_file

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

    from ctxgate.policies.schema import Policy

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
    from ctxgate.gateway.key_admin import add_key
    from ctxgate.gateway.keys import Limits

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

    from ctxgate.gateway.keys import read_keys_file

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
    from ctxgate.gateway.key_admin import revoke_key

    for key_id in args.key_ids:
        tenant, entry = revoke_key(args.keys, key_id)
        print(f"revoked {entry.key_id} (tenant '{tenant}') at {entry.revoked_at.isoformat()}")
    return 0


def _keys_rotate(args: argparse.Namespace) -> int:
    from ctxgate.gateway.key_admin import rotate_key

    grace = parse_duration(args.grace) if args.grace else 0.0
    tenant, key, old = rotate_key(args.keys, args.key_id, grace_s=grace)
    print(key)
    ending = f"expires at {old.expires_at.isoformat()}" if grace else "is revoked"
    print(f"new key for tenant '{tenant}' stored in {args.keys}; the old key {old.key_id} {ending}", file=sys.stderr)
    return 0
