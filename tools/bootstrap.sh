#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install the verified stack.
#
# Idempotent: a completed environment is recorded in .venv/.linattn_stack; when the recorded stack
# matches STACK below and the project is importable, nothing is reinstalled.
#
# Usage: bash tools/bootstrap.sh        (prints the path of the environment's python on the last line)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LINATTN_VENV:-$ROOT/.venv}"
PY_BOOT="${PYTHON:-python3}"
STACK="$(cat "$ROOT/tools/constraints.txt") torch===2.13.0 torchvision==0.28.0 setuptools<81 mmengine==0.10.7 mmcv==2.1.0 mmdet==3.3.0 mmsegmentation==1.2.2 mmpretrain==1.2.0 ftfy regex pytest pytest-xdist==3.8.0 click model-index colorama tabulate pandas requests openmim==0.3.9(no-deps)"
MARK="$VENV/.linattn_stack"

log() { printf '[bootstrap %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# pip install with this machine's noise removed: local mirrors listed in pip.conf that lack a
# package make pip print one "Location ... is ignored" warning per package. Exit status is pip's.
pip_install() {
    "${PIP[@]}" "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
}

if [ -f "$MARK" ] && [ "$(cat "$MARK")" = "$STACK" ] && "$VENV/bin/python" -c "import linattn_mm, mmcv.ops, mmdet, mmseg, mmpretrain, mim, xdist" 2>/dev/null; then
    log "environment $VENV is complete; reusing it"
    echo "$VENV/bin/python"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment $VENV"
    "$PY_BOOT" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check -c "$ROOT/tools/constraints.txt")

log "step 1/5: build tools (setuptools<81: mmcv and mmengine import pkg_resources)"
pip_install -q "setuptools<81" wheel ninja

# '===' is an exact string match: it refuses the local '2.13.0+cpu' wheel, which has no torchvision.
log "step 2/5: torch 2.13.0 (regular wheel) + torchvision 0.28.0"
pip_install -q "torch===2.13.0" "torchvision==0.28.0"

log "step 3/5: mmengine 0.10.7"
pip_install -q "mmengine==0.10.7"

if "$PY" -c "import mmcv, mmcv.ops; assert mmcv.__version__ == '2.1.0'" 2>/dev/null; then
    log "step 4/5: mmcv 2.1.0 with ops already installed"
else
    log "step 4/5: mmcv 2.1.0 with compiled ops (first build takes about 15 minutes on 2 cores; pip caches the wheel)"
    start=$(date +%s)
    # Keep the full log; print one progress line per 10 compiled sources.
    BUILD_LOG="$VENV/mmcv-build.log"
    set +e
    MMCV_WITH_OPS=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" "${PIP[@]}" -v --no-build-isolation "mmcv==2.1.0" 2>&1 \
        | tee "$BUILD_LOG" \
        | awk -v start="$start" '
            match($0, /\[[0-9]+\/[0-9]+\]/) {
                split(substr($0, RSTART + 1, RLENGTH - 2), kn, "/")
                if (kn[1] % 5 == 0 || kn[1] == kn[2]) {
                    printf("[bootstrap] mmcv build: compiled %d/%d sources (%d s)\n", kn[1], kn[2], systime() - start) > "/dev/stderr"
                    fflush("/dev/stderr")
                }
            }
            /Using cached mmcv|Successfully installed|Building wheel for mmcv|Stored in directory/ { print "[bootstrap] " $0 > "/dev/stderr"; fflush("/dev/stderr") }'
    rc=${PIPESTATUS[0]}
    set -e
    if [ "$rc" -ne 0 ]; then
        tail -n 40 "$BUILD_LOG" >&2
        log "mmcv build failed (full log: $BUILD_LOG)"
        exit "$rc"
    fi
    log "mmcv ready after $(( $(date +%s) - start )) s"
fi

log "step 5/5: mmdet 3.3.0, mmsegmentation 1.2.2, mmpretrain 1.2.0, test tools (pytest, pytest-xdist, openmim), linattn_mm (editable)"
pip_install -q "mmdet==3.3.0" "mmsegmentation==1.2.2" "mmpretrain==1.2.0" ftfy regex pytest "pytest-xdist==3.8.0" "torch===2.13.0"
# openmim (tests/e2e/test_mim.py: `mim train/test mmdet CONFIG`) without its dependency chain: its
# opendatalab -> openxlab requirement pins setuptools~=60.2, requests, rich, tqdm, filelock and
# packaging to old versions. These are the packages mim imports (pip is there already).
pip_install -q click model-index colorama tabulate pandas requests
pip_install -q --no-deps "openmim==0.3.9"
if [ -f "$ROOT/setup.py" ]; then
    pip_install -q --no-build-isolation --no-deps -e "$ROOT"
fi

"$PY" -c "import torch, mmcv, mmcv.ops, mmengine, mmdet, mmseg, mmpretrain; print('[bootstrap] torch', torch.__version__, 'mmcv', mmcv.__version__, 'mmdet', mmdet.__version__, 'mmseg', mmseg.__version__, 'mmpretrain', mmpretrain.__version__)" >&2
if [ -f "$ROOT/setup.py" ]; then
    echo "$STACK" > "$MARK"
fi
log "environment ready: $VENV"
echo "$PY"
