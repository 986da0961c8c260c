#!/usr/bin/env bash
# One prepared check for a lent accelerator machine (written for the NVIDIA H200 of the device tool).
#
#   bash scripts/accelerator_check.sh [OUT_DIR]      (default: $OUT, else ./accelerator-results)
#
# 1. makes a venv on top of a Python whose torch sees the accelerator (the image's
#    /opt/torch/.venv/bin/python3 there: torch CUDA build, transformers, accelerate 1.15.0,
#    pytest, safetensors are preinstalled and nothing can be downloaded), installs wheels
#    carried in .whl/ if any, then bigmodel from this checkout (no dependencies fetched);
#    where a registry is reachable, missing torch / accelerate==1.15.0 are pip-installed;
# 2. runs the accelerator tests (pytest -m accelerator) and the CPU logic tests of the transfer layer;
# 3. runs benchmarks/gpu_offload.py (bigmodel vs accelerate 1.15.0 vs all-on-GPU);
# and writes everything into OUT_DIR (at most 8 files: the device tool brings back 8):
#   check.log  env.txt  pytest-accelerator.log  junit-accelerator.xml  pytest-transfer.log
#   bench.log  gpu_offload.json  gpu_offload.md
# Fits in 10 minutes: every step has its own timeout; a failing step is recorded and the next runs.
# Exit status: 0 if every step passed, 1 otherwise (see check.log's summary).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$REPO/accelerator-results}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
exec > >(tee -a "$OUT_DIR/check.log") 2>&1
cd "$REPO"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
START=$(date +%s)
VENV="${BIGMODEL_CHECK_VENV:-/tmp/bigmodel-accel-venv}"
STATUS=()

say() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"; }
step() {  # step NAME TIMEOUT_S LOGFILE CMD...: run with a timeout, log, record the outcome
    local name=$1 limit=$2 logfile=$3; shift 3
    say "step $name (limit ${limit}s) -> $logfile"
    local rc=0
    timeout --kill-after=10 "$limit" "$@" >"$logfile" 2>&1 || rc=$?
    tail -n 40 "$logfile" || true
    if [[ $rc -eq 0 ]]; then
        STATUS+=("$name: ok")
    elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
        STATUS+=("$name: FAILED (timed out after ${limit}s)")
    else
        STATUS+=("$name: FAILED (rc=$rc)")
    fi
    say "step $name: rc=$rc"
    return 0
}

# ---------------------------------------------------------------- 1. environment
pick_python() {
    local candidate
    if [[ -n "${BIGMODEL_BASE_PYTHON:-}" ]]; then echo "$BIGMODEL_BASE_PYTHON"; return 0; fi
    for candidate in /opt/torch/.venv/bin/python3 python3; do
        [[ -n "$candidate" ]] && command -v "$candidate" >/dev/null 2>&1 || continue
        if timeout 120 "$candidate" -c "import torch, sys; sys.exit(0 if torch.accelerator.is_available() else 1)" 2>/dev/null; then
            echo "$candidate"; return 0
        fi
    done
    command -v python3
}
BASE_PY="$(pick_python)"
say "base python: $BASE_PY"
make_venv() {  # a venv that sees the base python's packages; falls back to the base python itself
    "$BASE_PY" -m venv --system-site-packages "$VENV" 2>/dev/null \
        || "$BASE_PY" -m venv --without-pip --system-site-packages "$VENV" || return 1
    # The base python may itself be a venv (the image's /opt/torch/.venv): --system-site-packages
    # would then see the interpreter's packages, not the venv's, so a .pth file adds the latter.
    local site
    site="$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")" || return 1
    "$BASE_PY" - >"$site/_bigmodel_base_image.pth" <<'EOF'
import sysconfig
paths = sysconfig.get_paths()
for folder in dict.fromkeys([paths["purelib"], paths["platlib"]]):
    print(f"import site; site.addsitedir({folder!r})")  # addsitedir also reads that folder's .pth files
EOF
}
rm -rf "$VENV"
if make_venv; then
    PY="$VENV/bin/python"
else
    say "could not create a venv; using $BASE_PY directly"
    PY="$BASE_PY"
fi
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
    say "installing carried wheels from .whl/"
    if ! timeout 180 "$PY" -m pip install -q --no-index --no-deps --no-compile "$REPO"/.whl/*.whl; then
        STATUS+=("carried wheels: FAILED")
    fi
fi
NO_PIP="${BIGMODEL_CHECK_NO_PIP:-0}"  # 1: never reach for a registry
if [[ "$NO_PIP" != 1 ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.accelerator.is_available() else 1)" 2>/dev/null; then
    say "torch with an accelerator not found: trying pip (CUDA 13.0 build)"
    timeout 300 "$PY" -m pip install -q --retries 0 --timeout 15 torch --index-url https://download.pytorch.org/whl/cu130 \
        || say "could not install torch: carry a CUDA torch wheel in .whl/ (see .library/device/README.md)"
fi
if [[ "$NO_PIP" != 1 ]] && ! "$PY" -c "import accelerate, sys; sys.exit(0 if accelerate.__version__ == '1.15.0' else 1)" 2>/dev/null; then
    say "accelerate==1.15.0 not found: trying pip"
    timeout 120 "$PY" -m pip install -q --retries 0 --timeout 15 --no-deps "accelerate==1.15.0" || say "accelerate==1.15.0 unavailable: its benchmark cases are skipped"
fi
# bigmodel itself: dependencies come from the base image (nothing is fetched); fall back to src/ on the path.
if ! timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e "$REPO" 2>"$OUT_DIR/env.txt"; then
    say "editable install failed (see env.txt); using PYTHONPATH=src"
    export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
fi
{
    echo "== date"; date -u
    echo "== nvidia-smi"; timeout 30 nvidia-smi || true
    echo "== python packages"
    timeout 120 "$PY" - <<'EOF' || true
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("accelerator", torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None)
if torch.accelerator.is_available() and torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for name in ("bigmodel", "accelerate", "transformers", "safetensors", "pytest", "pytest_timeout", "hypothesis", "psutil", "tqdm", "gguf"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as error:
        print(name, "MISSING", type(error).__name__, error)
EOF
} >>"$OUT_DIR/env.txt" 2>&1
say "environment written to env.txt"

# ---------------------------------------------------------------- 2. tests
TIMEOUT_OPT=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_OPT=(--timeout 120); fi
mapfile -t MARKED < <(grep -l "pytest.mark.accelerator" tests/test_*.py || true)
if [[ ${#MARKED[@]} -eq 0 ]]; then MARKED=(tests/test_accelerator.py); fi
step "pytest -m accelerator" 240 "$OUT_DIR/pytest-accelerator.log" \
    "$PY" -m pytest -m accelerator -p no:cacheprovider -q -rA --continue-on-collection-errors "${TIMEOUT_OPT[@]}" \
    --junitxml="$OUT_DIR/junit-accelerator.xml" "${MARKED[@]}"
step "pytest transfer logic" 120 "$OUT_DIR/pytest-transfer.log" \
    "$PY" -m pytest -p no:cacheprovider -q -rfE "${TIMEOUT_OPT[@]}" tests/test_transfer.py

# ---------------------------------------------------------------- 3. benchmark
ELAPSED=$(( $(date +%s) - START ))
BENCH_LIMIT=$(( 570 - ELAPSED ))
if (( BENCH_LIMIT < 120 )); then BENCH_LIMIT=120; fi
step "gpu_offload benchmark" "$BENCH_LIMIT" "$OUT_DIR/bench.log" \
    "$PY" -W ignore::FutureWarning benchmarks/gpu_offload.py "$OUT_DIR" --repeats "${BIGMODEL_BENCH_REPEATS:-3}" \
    --prefill "${BIGMODEL_BENCH_PREFILL:-2048,16384}" --budget "${BIGMODEL_BENCH_BUDGET:-3GiB}" ${BIGMODEL_BENCH_ARGS:-}

# ---------------------------------------------------------------- summary
say "summary (total $(( $(date +%s) - START )) s):"
FAILED=0
for line in "${STATUS[@]}"; do
    echo "  $line"
    if [[ "$line" == *FAILED* ]]; then FAILED=1; fi
done
if [[ -f "$OUT_DIR/gpu_offload.md" ]]; then cat "$OUT_DIR/gpu_offload.md"; fi
exit "$FAILED"
