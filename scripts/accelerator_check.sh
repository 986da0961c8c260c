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
# 2. runs the accelerator tests (pytest -m accelerator: tests/transfer/test_accelerator*.py, the
#    prefetch path under load with race wideners, failure injection, exit with a prefetch in flight);
# 3. runs the CPU suites whose behaviour changes once pinned memory is on (dispatch, prefetch,
#    transfer, the transformers integration) -- skipped on a machine without an accelerator, where
#    they are CI's ordinary suites;
# 4. runs a trimmed benchmarks/gpu_offload.py (bigmodel vs accelerate 1.15.0 vs all-on-GPU): output
#    checks (bigmodel == accelerate bit for bit, every case ~ all-on-GPU within tolerance), the H2D
#    bandwidth of offloaded forwards against the measured pinned-copy bandwidth, and the overlap
#    of copies with compute.  Without an accelerator it runs as a CPU smoke test of the script.
# and writes everything into OUT_DIR (at most 8 files: the device tool brings back 8):
#   check.log  env.txt  pytest-accelerator.log  junit-accelerator.xml  pytest-cpu.log
#   bench.log  gpu_offload.json  gpu_offload.md
# About 5 minutes on one H200 (a rerun fits in a 15-minute device window); every step has its own
# timeout and the whole script stays under 9 minutes; a failing step is recorded and the next runs.
# Exit status: 0 if every step passed, 1 otherwise (see check.log's summary).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$REPO/accelerator-results}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
if [[ -z "${BIGMODEL_CHECK_LOGGING:-}" ]]; then  # run once more with everything going to check.log too
    set +e
    BIGMODEL_CHECK_LOGGING=1 bash "${BASH_SOURCE[0]}" "$OUT_DIR" 2>&1 | tee -a "$OUT_DIR/check.log"
    exit "${PIPESTATUS[0]}"  # tee has finished: check.log is complete when OUT_DIR is collected
fi
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

HAVE_ACCEL=0
if "$PY" -c "import torch, sys; sys.exit(0 if torch.accelerator.is_available() else 1)" 2>/dev/null; then HAVE_ACCEL=1; fi
say "accelerator seen by torch: $HAVE_ACCEL"
skip() {  # skip NAME WHY: record a step that did not run
    STATUS+=("$1: skipped ($2)")
    say "step $1: skipped ($2)"
}

# ---------------------------------------------------------------- 2. accelerator tests
TIMEOUT_OPT=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_OPT=(--timeout 150); fi
mapfile -t MARKED < <(grep -rl --include='test_*.py' "pytest.mark.accelerator" tests | sort || true)
say "accelerator test files: ${MARKED[*]:-none}"
if [[ ${#MARKED[@]} -eq 0 ]]; then
    skip "pytest -m accelerator" "no test file carries the accelerator marker"
else  # without an accelerator every test skips: a dry run of collection and imports
    step "pytest -m accelerator" 240 "$OUT_DIR/pytest-accelerator.log" \
        "$PY" -m pytest -m accelerator -p no:cacheprovider -q -rA --continue-on-collection-errors "${TIMEOUT_OPT[@]}" \
        --junitxml="$OUT_DIR/junit-accelerator.xml" "${MARKED[@]}"
fi

# ---------------------------------------------------------------- 3. CPU suites with pinned memory on
CPU_SUITES=(tests/dispatch tests/transfer tests/integrations/test_hf.py)
if [[ "$HAVE_ACCEL" == 1 ]]; then
    step "pytest CPU suites (pinned memory on)" 180 "$OUT_DIR/pytest-cpu.log" \
        "$PY" -m pytest -m "not accelerator and not slow" -p no:cacheprovider -q -rfE --maxfail=10 "${TIMEOUT_OPT[@]}" \
        "${CPU_SUITES[@]}"
else
    skip "pytest CPU suites (pinned memory on)" "no accelerator: pinned memory stays off, these are CI's suites"
fi

# ---------------------------------------------------------------- 4. benchmark
ELAPSED=$(( $(date +%s) - START ))
BENCH_LIMIT=$(( 520 - ELAPSED ))
if (( BENCH_LIMIT > 300 )); then BENCH_LIMIT=300; fi
if (( BENCH_LIMIT < 120 )); then BENCH_LIMIT=120; fi
if [[ "$HAVE_ACCEL" == 1 ]]; then
    step "gpu_offload benchmark" "$BENCH_LIMIT" "$OUT_DIR/bench.log" \
        "$PY" -W ignore::FutureWarning benchmarks/gpu_offload.py "$OUT_DIR" --repeats "${BIGMODEL_BENCH_REPEATS:-2}" \
        --prefill "${BIGMODEL_BENCH_PREFILL:-2048}" --decode-steps "${BIGMODEL_BENCH_DECODE_STEPS:-8}" \
        --budget "${BIGMODEL_BENCH_BUDGET:-3GiB}" ${BIGMODEL_BENCH_ARGS:-}
else  # the same code on a toy model: the checks and the report run, the figures mean nothing
    step "gpu_offload benchmark (CPU smoke, no accelerator)" "$BENCH_LIMIT" "$OUT_DIR/bench.log" \
        "$PY" -W ignore::FutureWarning benchmarks/gpu_offload.py "$OUT_DIR" --preset tiny --device cpu \
        --repeats 1 --prefill 64 --decode-steps 2
fi

# ---------------------------------------------------------------- summary
say "summary (total $(( $(date +%s) - START )) s):"
FAILED=0
for line in "${STATUS[@]}"; do
    echo "  $line"
    if [[ "$line" == *FAILED* ]]; then FAILED=1; fi
done
if [[ -f "$OUT_DIR/gpu_offload.md" ]]; then cat "$OUT_DIR/gpu_offload.md"; fi
say "files in $OUT_DIR: $(cd "$OUT_DIR" && ls | tr '\n' ' ')"
exit "$FAILED"
