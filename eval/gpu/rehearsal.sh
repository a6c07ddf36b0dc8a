#!/usr/bin/env bash
# `make gpu-rehearsal`: the GPU check's very command on this CPU machine, in the GPU machine's
# conditions minus the GPU: no network (unshare -n), Python 3.12 with only what that machine holds
# (eval/gpu/machine_requirements.txt: torch 2.11, the CUDA 13 build, which runs on a CPU too) plus
# the carried wheels (gpu-wheels/, installed --no-index --no-deps) and the project (--no-deps).
#
#   eval/gpu/rehearsal.sh [OUT]          # default OUT: gpu-rehearsal-out/
# Knobs: PYTHON312 (default: pyenv's 3.12, else python3.12), SHAPES (default smollm2-135m).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
out=${1:-gpu-rehearsal-out}
base=.gpu-rehearsal/venv
py312=${PYTHON312:-$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python 2>/dev/null | tail -1)}
py312=${py312:-python3.12}

# The machine's own packages: built once, with the network (this is "what the GPU machine has").
if [ ! -f "$base/.machine-installed" ] || [ eval/gpu/machine_requirements.txt -nt "$base/.machine-installed" ]; then
    rm -rf "$base"
    "$py312" -m venv "$base"
    "$base/bin/pip" install -q -r eval/gpu/machine_requirements.txt
    touch "$base/.machine-installed"
fi

checkout_kib=$(git ls-files -z | du -c --files0-from=- -k | tail -1 | cut -f1)
wheels_kib=$(du -ck gpu-wheels/*.whl | tail -1 | cut -f1)
echo "carried: checkout $((checkout_kib / 1024)) MiB + wheels $((wheels_kib / 1024)) MiB = $(((checkout_kib + wheels_kib) / 1024)) MiB (limit 64 MiB)"
[ $((checkout_kib + wheels_kib)) -le $((64 * 1024)) ]

# From here on, exactly what the GPU machine runs (eval/gpu/run_on_gpu.sh), with no network.
unshare -n env PYTHON="$repo/$base/bin/python" SHAPES="${SHAPES:-smollm2-135m}" bash eval/gpu/run_on_gpu.sh "$out"
