#!/usr/bin/env bash
# Multi-process testing with torchrun: bash tools/dist_test.sh CONFIG CHECKPOINT NPROC [test.py args]
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: bash tools/dist_test.sh CONFIG CHECKPOINT NPROC [test.py args ...]" >&2
    exit 2
fi
CONFIG=$1
CHECKPOINT=$2
NPROC=$3
shift 3
# The interpreter: $PYTHON if set; else the active virtual / conda environment's python; else
# the project's .venv (made by tools/bootstrap.sh), whose python the other commands call.
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -z "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && [ -x "$ROOT/.venv/bin/python" ]; then
        PYTHON="$ROOT/.venv/bin/python"
    else
        PYTHON=python
    fi
fi
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="${NNODES:-1}" --node_rank="${NODE_RANK:-0}" \
    --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${PORT:-29500}" \
    --nproc_per_node="$NPROC" \
    "$ROOT/tools/test.py" "$CONFIG" "$CHECKPOINT" --launcher pytorch "$@"
