"""`ctxgate serve`, `ctxgate config check|schema`, `ctxgate policy check|schema`, `ctxgate keys ...` (import-light)."""

from __future__ import annotations

import argparse
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
from ctxgate.gateway.keys_cli import register_keys
from ctxgate.gateway.settings import GatewaySettings


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible budget gateway")
    serve.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="YAML config file (see `ctxgate config schema`); flags given here override it",
    )
    # Every other flag is a settings field (gateway/settings.py, backend/engine/config.py), with no argparse
    # default: what is not given comes from the config file, then from the field's default.
    add_model_flags(serve, GatewaySettings, skip=SERVER_SKIP)
    # --model and the in-process engine's knobs, as in `engine serve`
    add_model_flags(serve, EngineConfig, title="engine (the built-in engine; unused with upstreams)")
    # For the reference docs: the defaults that apply when neither a flag nor the file sets a value.
    serve.set_defaults(
        func=_serve,
        flag_defaults={**static_defaults(GatewaySettings, SERVER_SKIP), **static_defaults(EngineConfig)},
    )

    config = subparsers.add_parser("config", help="validate a `serve --config` file and print its schema")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    config_check = config_sub.add_parser(
        "check", help="validate config files (environment references included)"
    )
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

    register_keys(subparsers)


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

    from ctxgate.backend.platform.malloc_arenas import limit_malloc_arenas

    limit_malloc_arenas()  # before any thread allocates: see the module

    resolved = resolve_serve_args(args)
    settings = resolved.settings

    from ctxgate.gateway.settings import exposure_problem

    problem = exposure_problem(settings)
    if problem is not None:
        print(f"ctxgate serve: {problem}", file=sys.stderr)
        return 2
    from ctxgate.gateway.preflight import preflight_problems

    # Before the model loads (seconds to minutes): a wrong path fails now, every problem listed.
    problems = preflight_problems(settings, resolved.engine)
    if problems:
        for line in problems:
            print(f"ctxgate serve: {line}", file=sys.stderr)
        return 2
    _log_request_ids()
    from ctxgate.gateway.app import create_app
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
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=resolved.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
    )
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
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")
        )


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
    """The files and folders a config names exist and parse (what `serve` checks before the model loads)."""
    from ctxgate.gateway.preflight import preflight_problems

    try:
        settings = GatewaySettings(
            **config.server_values(), model=config.engine.model, model_list=config.model_list
        )
    except ValidationError as exc:
        return describe_errors(exc, lambda name: f"field 'server.{name}'", "server")
    return preflight_problems(settings, config.engine)


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
