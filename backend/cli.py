"""`ctxgate model ...` and `ctxgate engine ...` commands."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="manage the local model")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    prepare = model_sub.add_parser(
        "prepare", help="convert the packaged SmolLM2 GGUF into a cached Hugging Face directory"
    )
    prepare.add_argument("--force", action="store_true", help="convert again even if cached")
    prepare.set_defaults(func=_model_prepare)


def _model_prepare(args: argparse.Namespace) -> int:
    from backend.model_prepare import prepare_default_model

    print(prepare_default_model(force=args.force))
    return 0
