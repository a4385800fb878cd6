#!/usr/bin/env bash
# The main job on the embedded demo data: set up the environment (first time only), generate the
# demo data, train a Mask R-CNN with a linattn_mm backbone, and print COCO bbox / segm AP from
# tools/test.py. CONFIG (any mmdet / mmseg / mmpretrain config) runs through the demo overlay
# (--demo: the demo data, its schedule, no pretrained file, the CPU settings).
#   bash tools/demo.sh [CONFIG] [extra train.py args ...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$(bash tools/bootstrap.sh | tail -n 1)"
CONFIG="${1:-configs/polaformer/mask-rcnn_pola-nat-tiny_fpn_300it_coco.py}"
shift $(( $# > 0 ? 1 : 0 ))
WORK="work_dirs/demo/$(basename "$CONFIG" .py)"
export PYTHONUNBUFFERED=1
start=$(date +%s)
"$PY" tools/make_demo_data.py --root data/demo
"$PY" tools/train.py "$CONFIG" --demo --work-dir "$WORK" --cfg-options randomness.seed=0 "$@"
CKPT="$(cat "$WORK/last_checkpoint")"
"$PY" tools/test.py "$CONFIG" "$CKPT" --demo --work-dir "$WORK" | tee "$WORK/test_output.txt"
echo "demo finished in $(( $(date +%s) - start )) s; checkpoint: $CKPT"
grep -h "linattn_mm metrics" "$WORK/test_output.txt"
