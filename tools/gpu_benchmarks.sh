#!/usr/bin/env bash
# The CUDA tests and the main GPU figures of docs/benchmarks.md in one run, on a machine with one
# CUDA GPU where the plugin and its OpenMMLab stack are installed (the Python given by $PYTHON,
# default `python`):
#
#   bash tools/gpu_benchmarks.sh OUT_DIR [PART ...]   # all parts, or the ones named
#   bash tools/gpu_benchmarks.sh --print [PART ...]   # print the commands, run nothing
#
# Parts (in this order; each writes OUT_DIR/PART.log, the benchmarks also OUT_DIR/PART.json):
#   tests         the CUDA tests (every test of tests/kernels and tests/models with "cuda" in
#                 its name): the Triton cores and the fused cores' kernels compiled and checked
#                 against the float64 reference, the CUDA training forms, autocast, the
#                 inference conversion
#   train_fused   the question of 0.6.13-0.6.14 in a few minutes: training steps at 800×1344,
#                 bf16 autocast, batch 8, of Pola-Swin-T, NaLaFormer-T and Pola-PVT-T on the torch
#                 and the fused cores (NaLaFormer's blocks with their fused conv sums) against the
#                 stock Swin-T and PVT-T (fewer rounds than train_b8)
#   profile_fused where the time of the fused forms' steps goes, in a minute or two: three bf16
#                 training steps at batch 8 of NaLaFormer-T and Pola-Swin-T on the fused forms
#                 under torch.profiler (their Triton kernels by name)
#   fused_w8, fused_e1024
#                 the same steps (five timed, one profiled) with the fused kernels launched
#                 another way (benchmark.py --fused-launch): 8 warps a program instead of 4, or
#                 tiles of 1024 elements instead of 2048; each halves the tile a thread holds
#                 (NaLa's query gradients: 200 registers a thread with 4 warps, 2 programs a
#                 Hopper multiprocessor; 141 with tiles of 1024, 3 programs), against the stock
#                 Swin-T in the same run
#   pola_core     the Pola core alone, forward and backward, bf16, 128² and 256² tokens, batch 8:
#                 Triton (its products in float32 and on the tensor cores, tf32x3; and its
#                 gradient passes launched as up to 0.6.11, w4b64) and the fused core (torch's
#                 products, Triton's elementwise passes) against the torch Function and the
#                 reference, with the achieved bandwidth and a profile of each (the kernels that
#                 take the most time)
#   nala_core     the same for the NaLa core
#   pola_core64, nala_core64
#                 the same at head dim 64, one head (Pola-PVT-T's and NaLaFormer-T's first stage),
#                 where the CUDA conversion keeps the torch core (max_head_dims) until these show
#                 the Triton cores faster
#   train_b8      training steps at 800×1344, bf16 autocast, batch 8: Pola-Swin-T, NaLaFormer-T
#                 and Pola-PVT-T (torch, fused and Triton cores) against the stock Swin-T and
#                 PVT-T
#   train_b1      the same at batch 1
#   train_profile where the time of those steps goes: three bf16 training steps at batch 8 of
#                 each backbone (torch and fused cores) under torch.profiler, the kernels that
#                 took the most GPU time
#   infer_b8      inference at 800×1344, bf16, batch 8: converted (Triton) and unconverted
#   infer_b1      the same at batch 1
#   maskrcnn      a Mask R-CNN training iteration, batch 2, 1333×800, float32: the Pola-Swin-T
#                 and NaLaFormer-T configs (torch, fused and Triton cores) against the stock Swin-T
#                 config
#                 (MMCV_OPS=torchvision: NMS and RoIAlign on torchvision's kernels, for an mmcv
#                 built without its CUDA ops)
#
# The first training steps on the Triton cores compile their kernels: on an H200 with 0.6.10's
# launch about 10 s for Pola-Swin-T and 80 s for NaLaFormer-T (its head dim 64 with the RoPE),
# within the warm-up; 0.6.11's launch at d = 64 compiles about 6x faster on a CPU for sm_90.
#
# Every part runs under its own time limit ($PART_LIMIT seconds, default 900); one that fails or
# runs out of time is reported at the end and the others still run; Ctrl-C stops the whole run.
# The exit status is that of the first part that failed (0 if none); 2 for bad arguments or a
# machine without a GPU.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"
LIMIT="${PART_LIMIT:-900}"
ALL=(tests train_fused profile_fused fused_w8 fused_e1024 pola_core nala_core pola_core64
     nala_core64 train_b8 train_b1 train_profile infer_b8 infer_b1 maskrcnn)
STOCK_SWIN_MRCNN='mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'
BACKBONES=(swin-t pola-swin-t nalaformer-t pvt-t pola-pvt-t)
# --log-progress: a part stopped by its time limit shows in its log how far it came
GPU=(--device cuda --warmup 3 --repeats 10 --log-progress)
# the training steps on the fused forms (train_fused, fused_w8, fused_e1024): bf16, batch 8
FUSED_STEPS=(--device cuda --log-progress --warmup 2 --repeats 5 --dtype bf16 --sizes 800x1344
             --batch 8)
# the profiled training steps (train_profile, profile_fused): a few, bf16, batch 8
PROFILE=(--device cuda --log-progress --warmup 2 --repeats 2 --dtype bf16 --sizes 800x1344
         --batch 8)

# the command of a part, one argument per line
part_command() {
    local out="$1" part="$2"
    case "$part" in
        tests)
            printf '%s\n' "$PY" -m pytest -q -p no:cacheprovider -rfE -k cuda \
                tests/kernels tests/models ;;
        pola_core|nala_core)
            printf '%s\n' "$PY" tools/benchmark.py --mode core --attn "${part%_core}" --backward \
                "${GPU[@]}" --dtype bf16 --grid 128x128 256x256 --batch 8 \
                --impls triton triton-tf32x3 triton-w4b64 fused torch reference --compare torch \
                --profile 5 --json "$out/$part.json" ;;
        pola_core64|nala_core64)
            printf '%s\n' "$PY" tools/benchmark.py --mode core --attn "${part%_core64}" \
                --backward "${GPU[@]}" --dtype bf16 --grid 128x128 256x256 --batch 8 \
                --heads 1 --head-dims 64 --impls triton fused torch reference --compare torch \
                --profile 5 --json "$out/$part.json" ;;
        train_fused)
            printf '%s\n' "$PY" tools/benchmark.py --mode train "${BACKBONES[@]}" \
                "${FUSED_STEPS[@]}" --impls fast fused --compare swin-t pola-pvt-t:pvt-t \
                --json "$out/$part.json" ;;
        train_b8|train_b1)
            printf '%s\n' "$PY" tools/benchmark.py --mode train "${BACKBONES[@]}" "${GPU[@]}" \
                --dtype bf16 --sizes 800x1344 --batch "${part#train_b}" --impls fast fused triton \
                --compare swin-t pola-pvt-t:pvt-t --json "$out/$part.json" ;;
        profile_fused)
            printf '%s\n' "$PY" tools/benchmark.py --mode train nalaformer-t pola-swin-t \
                "${PROFILE[@]}" --impls fused --profile 3 --json "$out/$part.json" ;;
        fused_w8|fused_e1024)
            local launch=8:2048
            [ "$part" = fused_e1024 ] && launch=4:1024
            printf '%s\n' "$PY" tools/benchmark.py --mode train swin-t nalaformer-t pola-swin-t \
                "${FUSED_STEPS[@]}" --impls fused --fused-launch "$launch" --compare swin-t \
                --profile 1 --json "$out/$part.json" ;;
        train_profile)
            printf '%s\n' "$PY" tools/benchmark.py --mode train "${BACKBONES[@]}" "${PROFILE[@]}" \
                --impls fast fused --profile 3 --json "$out/$part.json" ;;
        infer_b8|infer_b1)
            printf '%s\n' "$PY" tools/benchmark.py --mode backbone "${BACKBONES[@]}" "${GPU[@]}" \
                --dtype bf16 --sizes 800x1344 --batch "${part#infer_b}" --impls fast torch \
                --compare swin-t pola-pvt-t:pvt-t --json "$out/$part.json" ;;
        maskrcnn)
            printf '%s\n' "$PY" tools/benchmark.py --mode train \
                configs/polaformer/mask-rcnn_pola-swin-t_fpn_1x_coco.py \
                configs/nalaformer/mask-rcnn_nalaformer-t_fpn_1x_coco.py "$STOCK_SWIN_MRCNN" \
                --part model "${GPU[@]}" --sizes 800x1333 --batch 2 --impls fast fused triton \
                --mmcv-ops "${MMCV_OPS:-mmcv}" --compare "$STOCK_SWIN_MRCNN" \
                --json "$out/$part.json" ;;
        *)
            echo "gpu_benchmarks.sh: unknown part '$part' (parts: ${ALL[*]})" >&2
            return 2 ;;
    esac
}

PRINT=0
if [ "${1:-}" = "--print" ]; then
    PRINT=1
    OUT='OUT_DIR'
    shift
elif [ $# -ge 1 ] && [ -n "$1" ] && [ "${1#-}" = "$1" ]; then
    OUT="$(realpath -m -- "$1")"  # the caller's folder, before the repository root is entered
    shift
else
    echo "usage: bash tools/gpu_benchmarks.sh OUT_DIR [PART ...] | --print [PART ...]" \
         "(parts: ${ALL[*]})" >&2
    exit 2
fi
[ $# -gt 0 ] || set -- "${ALL[@]}"
case "$LIMIT" in
    ''|*[!0-9]*|0)
        echo "gpu_benchmarks.sh: PART_LIMIT must be a whole number of seconds, got '$LIMIT'" >&2
        exit 2 ;;
esac
cd "$ROOT"
for part in "$@"; do  # every name checked before anything runs
    part_command "$OUT" "$part" > /dev/null || exit 2
done

if [ "$PRINT" = 1 ]; then
    for part in "$@"; do
        mapfile -t cmd < <(part_command "$OUT" "$part")
        printf '%s:' "$part"
        printf ' %q' "${cmd[@]}"
        printf '\n'
    done
    exit 0
fi

if ! command -v "$PY" > /dev/null; then
    echo "gpu_benchmarks.sh: no Python '$PY' (set PYTHON to the interpreter with the plugin)" >&2
    exit 2
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_benchmarks.sh: $PY sees no CUDA GPU (torch.cuda.is_available() is False)" >&2
    exit 2
fi
mkdir -p "$OUT" || exit 2
trap 'echo "gpu_benchmarks.sh: stopped (Ctrl-C); logs so far in $OUT" >&2; exit 130' INT
if ! "$PY" - > "$OUT/machine.txt" 2>&1 <<'EOF'
import platform, torch
import linattn_mm
p = torch.cuda.get_device_properties(0)
print(f'linattn_mm {linattn_mm.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda}')
print(f'{p.name}, {p.total_memory / 2**20:.0f} MiB, {p.multi_processor_count} SMs; '
      f'{platform.processor() or platform.machine()}')
try:
    import triton
    print(f'triton {triton.__version__}')
except ImportError:
    print('triton: not installed (the Triton cores fall back to the torch kernels)')
EOF
then
    cat "$OUT/machine.txt" >&2
    echo "gpu_benchmarks.sh: $PY cannot import linattn_mm or read the GPU (above)" >&2
    exit 2
fi
cat "$OUT/machine.txt"

status=0
failed=()
for part in "$@"; do
    mapfile -t cmd < <(part_command "$OUT" "$part")
    echo "[gpu_benchmarks $(date +%T)] $part"
    # in the foreground: Ctrl-C reaches the part (between parts the trap above ends the run); a
    # part that ignores the end of its time is killed 30 s later
    timeout --foreground -k 30 "$LIMIT" "${cmd[@]}" > "$OUT/$part.log" 2>&1
    rc=$?
    tail -n 25 "$OUT/$part.log"
    if [ $rc -eq 130 ]; then  # the part stopped by Ctrl-C (where bash did not run the trap)
        echo "gpu_benchmarks.sh: stopped (Ctrl-C) in $part; logs so far in $OUT" >&2
        exit 130
    fi
    if [ $rc -ne 0 ]; then
        case $rc in
            124|137) why="ran past ${LIMIT} s" ;;
            *) why="exit status $rc" ;;
        esac
        failed+=("$part ($why)")
        [ $status -ne 0 ] || status=$rc
    fi
done
echo "[gpu_benchmarks $(date +%T)] done; logs in $OUT"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'failed: %s\n' "${failed[@]}"
fi
exit $status
