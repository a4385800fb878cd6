#!/usr/bin/env bash
# Multi-process training with torchrun: bash tools/dist_train.sh CONFIG NPROC [train.py args ...]
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR, PORT. Without GPUs the gloo backend is used.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: bash tools/dist_train.sh CONFIG NPROC [train.py args ...]" >&2
    exit 2
fi
CONFIG=$1
NPROC=$2
shift 2
source "$(dirname "$0")/dist_python.sh"  # ROOT, PYTHON
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="${NNODES:-1}" --node_rank="${NODE_RANK:-0}" \
    --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${PORT:-29500}" \
    --nproc_per_node="$NPROC" \
    "$ROOT/tools/train.py" "$CONFIG" --launcher pytorch "$@"
