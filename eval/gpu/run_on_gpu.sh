#!/usr/bin/env bash
# The GPU check on the offline GPU machine, one command from the checkout's root:
#
#   bash eval/gpu/run_on_gpu.sh OUT [--quick]     # gpu-wheels/ must have travelled with the checkout
#
# Installs the carried wheels and the project (--no-index --no-deps) into a target folder, then runs
# `ctxgate bench gpu --out OUT`. Knobs: PYTHON (default python3), SHAPES (default: all four), WORK.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: run_on_gpu.sh OUT [--quick]}
shift
python=${PYTHON:-python3}
work=${WORK:-${TMPDIR:-/tmp}/ctxgate-gpu-check}
site=$work/site
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$out" "$work"
rm -rf "$site"
"$python" -m pip install -q --no-index --no-deps --target "$site" gpu-wheels/*.whl >"$out/install.log" 2>&1 &&
    "$python" -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" . >>"$out/install.log" 2>&1
rc=$?
[ $rc = 0 ] || { echo "install failed (rc $rc): $out/install.log"; tail -5 "$out/install.log"; }
export PYTHONPATH=$site
shapes=()
[ -n "${SHAPES:-}" ] && shapes=(--shapes "$SHAPES")
"$python" -m ctxgate.cli bench gpu --out "$out" --work "$work" "${shapes[@]}" "$@"
