"""`ctxgate index build`: chunk, embed and index a JSONL corpus for retrieval.

Import-light on purpose: the embedding model and FAISS load inside the command.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    index_parser = subparsers.add_parser("index", help="retrieval indexes (FAISS)")
    index_commands = index_parser.add_subparsers(dest="index_command", required=True, metavar="ACTION")
    build = index_commands.add_parser(
        "build", help="build an index from a JSONL corpus (one {'text', 'title'?, 'id'?} per line)"
    )
    build.add_argument("--input", required=True, help="JSONL file of documents")
    build.add_argument("--name", required=True, help="index name used by requests' retrieval.index")
    build.add_argument(
        "--index-dir",
        default=None,
        help="where indexes live (default $CTXGATE_INDEX_DIR or ~/.cache/ctxgate/indexes)",
    )
    build.add_argument("--chunk-words", type=int, default=120, help="max words per chunk (whole sentences)")
    build.set_defaults(func=run_build)


def run_build(args: argparse.Namespace) -> int:
    from ctxgate.compression.store.index import build_index

    if args.chunk_words < 8:
        raise ValueError("--chunk-words must be at least 8")
    target = build_index(args.input, args.name, args.index_dir, chunk_words=args.chunk_words)
    print(f"index {args.name!r} written to {target}")
    return 0
