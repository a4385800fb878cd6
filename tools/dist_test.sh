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
source "$(dirname "$0")/dist_python.sh"  # ROOT, PYTHON
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="${NNODES:-1}" --node_rank="${NODE_RANK:-0}" \
    --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${PORT:-29500}" \
    --nproc_per_node="$NPROC" \
    "$ROOT/tools/test.py" "$CONFIG" "$CHECKPOINT" --launcher pytorch "$@"
