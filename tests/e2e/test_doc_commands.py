"""Every shell command written in the docs is executed here, so the docs cannot rot.

The commands are read from the fenced code blocks of README.md, docs/*.md and docs/model_zoo/*.md:
blocks labelled ``bash`` / ``sh`` / ``shell``, and unlabelled blocks whose lines start with
``python``, ``.venv/bin/python``, ``bash`` or ``mim`` (optionally after ``ENV=value`` prefixes).
Backslash continuations are joined, trailing ``# comments`` stripped, runs of blanks collapsed.

``TABLE`` maps each command (its exact text) to how it is run: ``Run(case, how)`` names the test
case below that executes it and the substitutions applied, ``Exempt(reason)`` says why it cannot
run here. ``test_table_covers_every_doc_command`` fails on a doc command without a table entry
(and on table entries no doc has any more).

A command is run from its own doc text (:func:`doc_argv`) after these substitutions only; the tool,
its sub-command and every flag it writes are kept (:func:`_assert_same_tool_and_flags`), only
paths, sizes and budgets shrink:

* ``.venv/bin/python`` / ``python`` -> the interpreter running the tests;
* a real-data config ``configs/X/NAME.py`` -> the same config with ``--demo`` (the demo overlay:
  the generated demo data, its schedule, no pretrained file) and the ``--cfg-options`` of
  ``harness.short_run_options``: one training iteration on 2 demo images, a test pass on 2 images,
  no optimizer state in the checkpoint;
* outputs (``--work-dir``, ``--out``, ``--output-dir``, ``--out-dir``, ``--json``, ``--plot``)
  -> the test's tmp_path; the placeholders ``CONFIG`` / ``CHECKPOINT`` -> a demo config / the
  checkpoint an earlier command of the same case wrote; ``[...]`` optional arguments are given;
* ``8`` processes -> ``2`` (CPU, gloo);
* benchmark / visualisation sizes and repeats reduced (values stated in each ``how``).

Commands that depend on each other (train, then test its checkpoint) share one case; every other
runnable command is a case of its own (ids: file:line). A ``python`` command runs as a fresh
process forked from the harness's server, which has imported torch, mmengine and mmcv once
(``harness.run_python``; ``LINATTN_TEST_FORKSERVER=0``: real subprocesses); ``bash`` and ``mim``
commands run as they are.
"""
import glob
import os
import os.path as osp
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
from harness import CONFIGS, REPO, demo_form, metrics_of, run_python, short_run_options

TIMEOUT = 600  # seconds per command (the runs take 5-60 s on an idle 2-core machine)
DOC_FILES = ['README.md', 'docs/*.md', 'docs/model_zoo/*.md']
SHELL_INFO = {'bash', 'sh', 'shell'}
COMMAND_START = re.compile(r'^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*'
                           r'(?:python|\.venv/bin/python|bash|mim)(?:\s|$)')
FENCE = re.compile(r'^ {0,3}(`{3,}|~{3,})\s*([^\s`{]*)')


# ------------------------------------------------------------------------------------------------
# extraction
# ------------------------------------------------------------------------------------------------
def _block_commands(body):
    """(offset of the first physical line, command) for each command of a code block."""
    out, buf, first = [], [], None
    for i, raw in enumerate(body):
        line = raw.rstrip()
        if first is None:
            if not line.strip() or line.lstrip().startswith('#'):
                continue
            first = i
        cont = line.endswith('\\')
        if cont:
            line = line[:-1]
        buf.append(re.sub(r'(^|\s)#.*$', '', line).strip())
        if not cont:
            out.append((first, ' '.join(' '.join(buf).split())))
            buf, first = [], None
    if buf:
        out.append((first, ' '.join(' '.join(buf).split())))
    return [(i, c) for i, c in out if c]


def extract_commands(root=REPO):
    """[(file relative to root, 1-based line, command)] of every doc command."""
    files = []
    for pattern in DOC_FILES:
        files += sorted(glob.glob(osp.join(root, pattern)))
    found = []
    for path in files:
        with open(path, encoding='utf-8') as f:
            lines = f.read().split('\n')
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            fence, info = m.group(1), m.group(2).lower()
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                j += 1
            cmds = _block_commands(lines[i + 1:j])
            if info in SHELL_INFO or (info == '' and any(COMMAND_START.match(c)
                                                         for _, c in cmds)):
                rel = osp.relpath(path, root)
                found += [(rel, i + 2 + k, c) for k, c in cmds]
            i = j + 1
    return found


# ------------------------------------------------------------------------------------------------
# the table
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    case: str  # the case (key of CASES) that runs the command
    how: str   # the substitutions, in words


@dataclass(frozen=True)
class Exempt:
    reason: str


_SHORT = ('--demo + short_run_options (1 training iteration on 2 images, no validation); '
          '--work-dir tmp')
TABLE = {
    # ---- README.md
    'bash tools/demo.sh':
        Run('demo_sh', 'bash tools/demo.sh CONFIG --cfg-options ...: CONFIG is a tmp config that '
            'inherits the default config (the tiny Pola NAT Mask R-CNN) and cuts its test pass to '
            '2 images (demo.sh passes extra args to train.py only); --cfg-options cut training to 1 '
            'iteration on 2 images; data root data/demo as demo.sh uses it; LINATTN_VENV -> a '
            'wrapper of the test interpreter with a matching bootstrap stamp, so bootstrap.sh '
            'takes its reuse path and never installs; the work dir (work_dirs/demo/<tmp config '
            'name>) is removed afterwards'),
    'bash tools/run_tests.sh':
        Exempt('runs this test suite (it would run this file recursively)'),
    '.venv/bin/python tools/train.py configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py':
        Run('readme_train_test', _SHORT),
    '.venv/bin/python tools/test.py configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py '
    'work_dirs/.../epoch_12.pth':
        Run('readme_train_test', '--demo, test on 2 images; the checkpoint is the one the '
            'train command of this case wrote; --work-dir tmp'),
    'bash tools/dist_train.sh configs/swin/upernet_swin-t_8xb2-160k_ade20k-512x512.py 8':
        Run('readme_dist_train', '--demo, 8 -> 2 processes (gloo), short_run_options, '
            '--work-dir tmp'),
    # ---- docs/get_started.md
    'bash tools/dist_train.sh configs/swin/swin-t_in1k.py 8':
        Run('pretrain_finetune', '--demo, 8 -> 2 processes (gloo), short_run_options, '
            '--work-dir tmp'),
    '.venv/bin/python tools/train.py configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py --cfg-options '
    'model.backbone.init_cfg.checkpoint=work_dirs/swin-t_in1k/epoch_300.pth':
        Run('pretrain_finetune', _SHORT + '; the checkpoint is the one the dist_train command of '
            'this case wrote; model.backbone.init_cfg._delete_=True and '
            'model.backbone.init_cfg.type=Pretrained added because the demo overlay sets '
            'init_cfg=None (the real config has the Pretrained dict the doc option edits)'),
    '.venv/bin/python tools/test.py CONFIG CHECKPOINT [--out results.pkl] [--show-dir vis]':
        Run('readme_train_test', 'CONFIG: the Mask R-CNN Swin-T config and --demo, CHECKPOINT: '
            'the one the README train command wrote; both optional arguments given (--out tmp/results.pkl'
            ', --show-dir vis); test on 2 images; --work-dir tmp'),
    'bash tools/dist_train.sh CONFIG 8':
        Run('dist_train_config', 'CONFIG: configs/pvtv2/pvtv2-b0_in1k.py and --demo, 8 -> 2 '
            'processes (gloo), short_run_options, --work-dir tmp'),
    '.venv/bin/python tools/make_demo_data.py':
        Run('demo_overlay', 'unchanged (the demo data the tests use; up to date, so skipped)'),
    '.venv/bin/python tools/train.py configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py --demo':
        Run('demo_overlay', 'short_run_options; --work-dir tmp'),
    '.venv/bin/python tools/test.py configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py '
    'work_dirs/mask-rcnn_swin-t_fpn_1x_coco_demo/epoch_12.pth --demo':
        Run('demo_overlay', 'test on 2 images; the checkpoint is the one the train command of '
            'this case wrote; --work-dir tmp'),
    '.venv/bin/python -m linattn_mm.demo configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py -o '
    'work_dirs/mask-rcnn_swin-t_fpn_1x_coco_demo.py':
        Run('demo_config_mim', '-o tmp/mask-rcnn_swin-t_fpn_1x_coco_demo.py'),
    'mim train mmdet work_dirs/mask-rcnn_swin-t_fpn_1x_coco_demo.py --gpus 0':
        Run('demo_config_mim', 'the config the previous command of this case wrote; --work-dir '
            'tmp and the --cfg-options of short_run_options appended'),
    'NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 bash tools/dist_train.sh CONFIG 8':
        Exempt('multi-node: needs a second host (the single-node path of the same script is '
               'run by the dist_train cases)'),
    'srun -p PARTITION --ntasks=16 --gres=gpu:8 python tools/train.py CONFIG --launcher slurm':
        Exempt('needs a SLURM cluster (srun)'),
    'python tools/train.py CONFIG --compile-backbone':
        Exempt('inductor generates and builds the code of the training graphs: 21 minutes for '
               'one backbone on 2 cores; the next command takes the same path with the aot_eager '
               "backend (the graphs the compiler receives), and tests/models/test_compile.py "
               "checks every family's graph and gradients"),
    'python tools/train.py CONFIG --compile-backbone aot_eager':
        Run('train_compile', 'CONFIG: the Pola-Swin-T Mask R-CNN config and --demo, the '
            '--cfg-options of short_run_options, --work-dir tmp'),
    'python tools/train.py CONFIG --amp':
        Exempt("needs a GPU: mmengine's AmpOptimWrapper asserts CUDA (tests/models/test_amp.py "
               'runs the same autocast and loss scaling on CPU)'),
    'python tools/train.py CONFIG --amp --cfg-options optim_wrapper.dtype=bfloat16':
        Exempt("needs a GPU: mmengine's AmpOptimWrapper asserts CUDA (tests/models/test_amp.py "
               'runs bfloat16 autocast on CPU)'),
    '.venv/bin/python tools/get_flops.py configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py':
        Run('get_flops_maskrcnn', 'unchanged (800x1333; the parameters and MACs the doc quotes '
            'are checked)'),
    '.venv/bin/python tools/get_flops.py '
    'configs/poly/upernet_poly-swin-t_8xb2-160k_ade20k-512x512.py --part backbone':
        Run('get_flops_backbone', 'unchanged'),
    '.venv/bin/python tools/fidelity_report.py':
        Run('fidelity_report', '--only swin-t_in1k --out tmp/fidelity.md (one row instead of all '
            'and not over docs/fidelity.md)'),
    '.venv/bin/python tools/learning_check.py':
        Exempt('about 40 minutes on 2 cores (a benchmark); tests/e2e/test_learning_check.py runs this tool '
               'with --iters 2 on two families of both tasks and checks the section it writes'),
    '.venv/bin/python tools/browse_dataset.py '
    'configs/pvtv2/mask-rcnn_pvtv2-b0_fpn_1x_coco.py --demo --output-dir work_dirs/browse '
    '--max-images 4':
        Run('browse_dataset', '--output-dir tmp'),
    '.venv/bin/python tools/visualize_attention.py --out-dir work_dirs/attention':
        Run('visualize_attention', '--out-dir tmp; --models swin-t_in1k pola-swin-t_in1k added '
            '(2 of the 6 default models, to keep it short); --size 64 --panel 48 '
            '--entropy-queries 1'),
    '.venv/bin/python tools/visualize_attention.py --img demo.jpg --query 0.3 0.6 --models '
    'swin-t_in1k pola-swin-t_in1k --checkpoints swin_tiny.pth pola_swin_t.pth':
        Run('visualize_attention_checkpoints', '--img: a generated JPEG; the checkpoints: '
            "{'model': get_model(name).backbone.state_dict()} files written by the test; "
            '--out-dir tmp; --size 64 --panel 48 --entropy-queries 1'),
    # ---- docs/benchmarks.md
    'python tools/benchmark.py --mode attention --grid 128x128 --heads 3 --head-dims 32 --impls '
    'official reference fast --compare official --threads 1 --warmup 2 --repeats 15':
        Run('benchmark_attention', '--grid 16x16 --warmup 0 --repeats 1'),
    'python tools/benchmark.py --mode model configs/polaformer/pola-pvt-t_in1k.py '
    'configs/polaformer/pola-swin-t_in1k.py --sizes 224 --batch 8 --impls official fast '
    '--compare official --threads 1 --warmup 1 --repeats 7':
        Run('benchmark_model', '--sizes 64 --batch 1 --warmup 0 --repeats 1'),
    'python tools/benchmark.py --mode backbone pola-swin-t swin-t linattn-swin-t pola-pvt-t pvt-t '
    'linattn-pvt-t nalaformer-t nalaformer-t-linear --sizes 800x1344 --threads 1 --warmup 1 '
    '--repeats 3 --compare pola-swin-t:swin-t linattn-swin-t:swin-t pola-swin-t:linattn-swin-t '
    'pola-pvt-t:pvt-t pola-pvt-t:linattn-pvt-t nalaformer-t:swin-t nalaformer-t-linear:swin-t':
        Run('benchmark_backbone', '--sizes 64x96 --warmup 0 --repeats 1'),
    'python tools/benchmark.py --mode backbone pola-pvt-t pola-swin-t nalaformer-t-linear --sizes '
    '1024 2048 --threads 1 --warmup 1 --repeats 2 --json scale.json --plot scale.png':
        Run('benchmark_scale', '--sizes 64 96 --warmup 0 --repeats 1; --json / --plot -> tmp'),
    'python tools/benchmark.py --mode backbone nalaformer-t pvt-t --sizes 1024 2048 --threads 1 '
    '--warmup 1 --repeats 2':
        Run('benchmark_scale_softmax', '--sizes 64 96 --warmup 0 --repeats 1'),
    'python tools/benchmark.py --mode backbone global-pvt-t pola-pvt-t --sizes 256 512 --threads 1 '
    '--warmup 1 --repeats 2':
        Run('benchmark_global', '--sizes 64 96 --warmup 0 --repeats 1'),
    'python tools/benchmark.py --mode attention --attn nala --grid 128x128 --heads 3 --head-dims 32 '
    '--impls reference fast --compare reference --threads 1 --warmup 2 --repeats 15':
        Run('benchmark_nala_attention', '--grid 16x16 --warmup 0 --repeats 1'),
    'python tools/benchmark.py --mode backbone nalaformer-t swin-t --sizes 800x1344 --impls '
    'reference fast --threads 1 --warmup 1 --repeats 3 --compare reference nalaformer-t:swin-t':
        Run('benchmark_nala_backbone', '--sizes 64x96 --warmup 0 --repeats 1'),
    'python tools/benchmark.py --mode backbone pola-pvt-t pola-swin-t nalaformer-t-linear --sizes '
    '1024 2048 --threads 1 --warmup 1 --repeats 2 --heap-malloc --json scale_heap.json':
        Run('benchmark_scale_heap', '--sizes 64 96 --warmup 0 --repeats 1; --json -> tmp'),
    'python tools/benchmark.py --mode train swin-t pola-swin-t nalaformer-t pvt-t pola-pvt-t '
    '--sizes 800x1344 --device meta --warmup 0 --repeats 1 --compare swin-t pola-pvt-t:pvt-t '
    '--roofline h200':
        Run('benchmark_operations', 'as written (meta tensors: shapes only, a few seconds)'),
    'python tools/benchmark.py --mode train swin-t pola-swin-t pvt-t pola-pvt-t --sizes 800x1344 '
    '--device meta --warmup 0 --repeats 1 --impls fast triton --compare swin-t pola-pvt-t:pvt-t '
    '--roofline h200':
        Run('benchmark_triton_operations', 'as written (meta tensors: shapes only)'),
    'python tools/benchmark.py --mode train swin-t nalaformer-t nalaformer-t-linear --sizes '
    '800x1344 --device meta --warmup 0 --repeats 1 --impls fast triton --compare swin-t '
    '--roofline h200':
        Run('benchmark_triton_nala_operations', 'as written (meta tensors: shapes only)'),
    'python tools/benchmark.py --mode train swin-t pola-swin-t nalaformer-t pvt-t pola-pvt-t '
    '--sizes 800x1344 --device meta --dtype bf16 --warmup 0 --repeats 1 --impls fast triton '
    '--compare swin-t pola-pvt-t:pvt-t --roofline h200':
        Run('benchmark_bf16_operations', 'as written (meta tensors under CUDA\'s autocast)'),
    'python tools/benchmark.py --mode train swin-t pola-swin-t pvt-t pola-pvt-t --sizes 800x1344 '
    '--device meta --dtype bf16 --warmup 0 --repeats 1 --impls fast fused triton --compare '
    'swin-t pola-pvt-t:pvt-t --roofline h200':
        Run('benchmark_fused_pola_operations', 'as written (meta tensors under CUDA\'s autocast)'),
    'python tools/benchmark.py --mode train swin-t nalaformer-t --sizes 800x1344 --device meta '
    '--dtype bf16 --warmup 0 --repeats 1 --impls fast fused triton --compare swin-t --roofline '
    'h200':
        Run('benchmark_fused_nala_operations', 'as written (meta tensors under CUDA\'s autocast)'),
    'python tools/benchmark.py --mode train swin-t pola-swin-t nalaformer-t --sizes 800x1344 '
    '--device meta --dtype bf16 --warmup 0 --repeats 1 --impls triton --ops-by-module 8 '
    '--compare swin-t':
        Run('benchmark_ops_by_module', 'as written (meta tensors under CUDA\'s autocast)'),
    'python tools/benchmark.py --mode train pola-swin-t swin-t nalaformer-t nalaformer-t-linear '
    'linattn-swin-t --sizes 800x1344 --batch 1 --threads 1 --warmup 1 --repeats 5 --compare swin-t '
    'pola-swin-t:linattn-swin-t':
        Run('benchmark_train_backbones', '--sizes 64x96 --warmup 0 --repeats 1'),
    'python tools/benchmark.py --mode train pola-pvt-t pvt-t linattn-pvt-t --sizes 512x832 800x1344 '
    '--threads 1 --warmup 1 --repeats 5 --compare pvt-t pola-pvt-t:linattn-pvt-t':
        Run('benchmark_train_pvt', '--sizes 64x96 96x128 --warmup 0 --repeats 1'),
    "python tools/benchmark.py --mode train "
    "configs/polaformer/mask-rcnn_pola-swin-t_fpn_1x_coco.py "
    "'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py' --part model --sizes 800x1344 "
    "--threads 1 --warmup 1 --repeats 3 "
    "--compare 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'":
        Run('benchmark_train_mask_rcnn', '--sizes 128x192 --warmup 0 --repeats 1'),
    'python tools/benchmark.py --mode train pola-pvt-t pola-swin-t nalaformer-t-linear '
    'configs/padre/mask-rcnn_padre-swin-t_fpn_1x_coco.py '
    'configs/poly/mask-rcnn_poly-pvt-t_fpn_1x_coco.py --sizes 1024 2048 --threads 1 --warmup 0 '
    '--repeats 1':
        Run('benchmark_train_scale', '--sizes 64 96'),
    'python tools/benchmark.py --mode train configs/setformer/mask-rcnn_setformer-t_fpn_1x_coco.py '
    '--sizes 1024 2048 --threads 1 --warmup 0 --repeats 1':
        Run('benchmark_train_scale_setformer', '--sizes 64 96'),
    'python tools/benchmark.py --mode train configs/padre/mask-rcnn_padre-swin-t_fpn_1x_coco.py '
    'configs/poly/mask-rcnn_poly-pvt-t_fpn_1x_coco.py swin-t pvt-t --sizes 800x1344 --threads 1 '
    '--warmup 1 --repeats 3 --compare swin-t configs/poly/mask-rcnn_poly-pvt-t_fpn_1x_coco.py:pvt-t':
        Run('benchmark_train_padre_poly', '--sizes 64x96 --warmup 0 --repeats 1'),
    'python tools/benchmark.py --mode train pola-swin-t nalaformer-t swin-t linattn-swin-t '
    '--sizes 800x1344 --threads 1 --warmup 1 --repeats 1 --dtype bf16 --compare swin-t':
        Run('benchmark_train_bf16', '--sizes 64x96 --warmup 0'),
    'python tools/benchmark.py --mode core --device cuda --dtype bf16 --grid 128x128 256x256 '
    '--batch 8 --impls triton torch --compare torch':
        Run('benchmark_core', '--device cpu --dtype fp32 --impls torch reference --compare '
            'reference --grid 8x8 --batch 1 (no GPU in CI; the Triton kernel itself is tested '
            'through the interpreter by tests/kernels/test_pola_triton.py)'),
    'python tools/benchmark.py --mode core --attn nala --device cuda --dtype bf16 --grid 128x128 '
    '256x256 --batch 8 --impls triton torch --compare torch':
        Run('benchmark_nala_core', '--device cpu --dtype fp32 --impls torch reference --compare '
            'reference --grid 8x8 --batch 1 (no GPU in CI; the Triton kernel itself is tested '
            'through the interpreter by tests/kernels/test_nala_triton.py)'),
    # ---- docs/benchmarks.md, "On a GPU"
    'bash tools/gpu_benchmarks.sh gpu_figures':
        Exempt('needs a CUDA GPU: tests/e2e/test_gpu_benchmarks.py runs its benchmark commands '
               'on meta and on CPU, and checks its test files, parts and refusals'),
    'python tools/benchmark.py --mode core --attn pola --device cuda --dtype bf16 --grid 128x128 '
    '256x256 --batch 8 --warmup 3 --repeats 10 --impls triton torch reference --compare torch':
        Run('gpu_benchmark_core', '--device cpu --dtype fp32 --impls torch reference --compare '
            'reference --grid 8x8 --batch 1 --warmup 0 --repeats 1 (no GPU in CI; the Triton '
            'cores are checked on CUDA by tests/kernels/test_triton_cuda.py where there is one)'),
    'python tools/benchmark.py --mode backbone pola-swin-t nalaformer-t swin-t pola-pvt-t pvt-t '
    '--device cuda --dtype bf16 --sizes 800x1344 --batch 8 --warmup 3 --repeats 10 --impls fast '
    'torch --compare swin-t pola-pvt-t:pvt-t':
        Run('gpu_benchmark_backbone', '--device cpu --dtype fp32 --sizes 64x96 --batch 1 '
            '--warmup 0 --repeats 1 (no GPU in CI)'),
    'python tools/benchmark.py --mode train pola-swin-t nalaformer-t swin-t linattn-swin-t '
    'pola-pvt-t pvt-t --device cuda --dtype bf16 --sizes 800x1344 --batch 8 --warmup 3 '
    '--repeats 10 --compare swin-t pola-pvt-t:pvt-t':
        Run('gpu_benchmark_train', '--device cpu --sizes 64x96 --batch 1 --warmup 0 --repeats 1 '
            '(no GPU in CI; bf16 autocast on CPU)'),
    'python tools/benchmark.py --mode train pola-swin-t nalaformer-t swin-t linattn-swin-t '
    'pola-pvt-t pvt-t --device cuda --sizes 800x1344 --batch 1 --warmup 3 --repeats 10 '
    '--compare swin-t pola-pvt-t:pvt-t':
        Run('gpu_benchmark_train_fp32', '--device cpu --sizes 64x96 --warmup 0 --repeats 1 '
            '(no GPU in CI)'),
    "python tools/benchmark.py --mode train "
    "configs/polaformer/mask-rcnn_pola-swin-t_fpn_1x_coco.py "
    "configs/nalaformer/mask-rcnn_nalaformer-t_fpn_1x_coco.py "
    "'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py' --part model --device cuda "
    "--sizes 800x1333 --batch 2 --warmup 3 --repeats 10 "
    "--compare 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'":
        Run('gpu_benchmark_train_mask_rcnn', '--device cpu --sizes 128x192 --batch 1 '
            '--warmup 0 --repeats 1 (no GPU in CI)'),
    'python tools/benchmark.py --mode train swin-t pola-swin-t nalaformer-t pvt-t pola-pvt-t '
    '--device cuda --dtype bf16 --sizes 800x1344 --batch 8 --impls fast --compare swin-t '
    'pola-pvt-t:pvt-t --warmup 1 --repeats 3':
        Run('gpu_benchmark_train_h200', '--device cpu --sizes 64x96 --batch 1 --warmup 0 '
            '--repeats 1 (no GPU in CI; bf16 autocast on CPU)'),
    # ---- docs/new_detector_config.md
    '.venv/bin/python tools/train.py configs/mine/atss_swin-t_fpn_1x_coco.py':
        Run('new_detector_config', 'run in tmp: configs/mine/atss_swin-t_fpn_1x_coco.py is the '
            "doc's python block verbatim and tmp/data/demo links to the repository's demo data; "
            '--demo appended, then --cfg-options that put the doc\'s Pretrained init_cfg back '
            '(the demo overlay sets init_cfg=None) and those of short_run_options; its pretrained '
            "file checkpoints/swin_tiny_patch4_window7_224.pth is {'model': swin-t backbone state "
            "dict} written by the test; tools/train.py by absolute path"),
    # ---- docs/model_zoo/padre.md
    'python tools/padre_readings.py':
        Run('padre_readings', '--json tmp/readings.json appended (all rows and degrees: about '
            '10 s); the compact / full PADRe-DeiT-T parameters pinned in '
            'tests/models/test_padre.py, the compact Table 6 figures and the scan are checked'),
}

# ------------------------------------------------------------------------------------------------
# running a doc command
# ------------------------------------------------------------------------------------------------
_PYTHONS = {'python', '.venv/bin/python'}


def doc_argv(cmd, replace=None, values=None, extend=None, append=()):
    """The argv that runs doc command ``cmd`` (a TABLE key).

    Args:
        replace (dict): doc token -> token (configs, placeholders, process counts).
        values (dict): flag -> the values that replace the flag's values in the doc.
        extend (dict): flag -> values appended to the flag's values in the doc.
        append (list): extra tokens at the end.
    """
    assert cmd in TABLE and isinstance(TABLE[cmd], Run), cmd
    replace, values, extend = replace or {}, values or {}, extend or {}
    doc = [t.strip('[]') for t in shlex.split(cmd)]  # "[--out x]": the optional args are given
    assert set(replace) <= set(doc), (set(replace) - set(doc), cmd)
    assert set(values) | set(extend) <= set(doc), cmd
    out, flag = [], None
    for tok in doc:
        if tok.startswith('--'):
            if flag in extend:
                out += extend[flag]
            flag = tok
            out.append(tok)
            if tok in values:
                out += values[tok]
            continue
        if flag in values:
            continue  # replaced by values[flag]
        if not out and tok in _PYTHONS:
            tok = sys.executable
        out.append(replace.get(tok, tok))
    if flag in extend:
        out += extend[flag]
    out += list(append)
    _assert_same_tool_and_flags(doc, out)
    return out


def tiny_backbone_argv(cmd, **values):
    """:func:`doc_argv` of a backbone benchmark command of the docs at 64² and 96², no warm-up
    and one repeat (``values``: further flag -> values, e.g. ``json=[path]``)."""
    sizes = {'--sizes': ['64', '96'], '--warmup': ['0'], '--repeats': ['1']}
    return doc_argv(cmd, values={**sizes, **{f'--{k}': v for k, v in values.items()}})


def _assert_same_tool_and_flags(doc, run):
    def tool(argv):
        exe = 'python' if argv[0] in _PYTHONS or argv[0] == sys.executable else argv[0]
        script = argv[1]
        if osp.isabs(script):
            script = osp.relpath(script, REPO)
        return exe, script

    assert tool(doc) == tool(run), (doc, run)
    flags = {t for t in doc if t.startswith('-')}
    assert flags <= set(run), (flags - set(run), run)


class Shell:
    """Runs the doc commands of one case and records which ones ran."""

    def __init__(self):
        self.ran = []

    def __call__(self, cmd, argv, cwd=REPO, env=None):
        self.ran.append(cmd)
        t0 = time.time()
        if argv[0] == sys.executable:  # as a fresh process (forked from the harness's server)
            res = run_python(argv[1:], cwd=cwd, env=env, timeout=TIMEOUT)
        else:
            res = subprocess.run(argv, cwd=cwd, env=dict(os.environ, PYTHONUNBUFFERED='1',
                                                         **(env or {})),
                                 capture_output=True, text=True, timeout=TIMEOUT)
        out = res.stdout + res.stderr
        print(f'[{time.time() - t0:5.1f} s] {shlex.join(argv)}')
        assert res.returncode == 0, (
            f'doc command failed (exit {res.returncode}):\n  {cmd}\nrun as:\n  '
            f'{shlex.join(argv)}\n--- output (tail) ---\n{out[-5000:]}')
        return out


def _cfg_options(config, demo=False):
    """short_run_options of ``config`` (in its demo form, what ``--demo`` runs, when ``demo``)."""
    from mmengine.config import Config
    return short_run_options(demo_form(config) if demo else Config.fromfile(config))


def _last_checkpoint(work_dir):
    with open(osp.join(work_dir, 'last_checkpoint')) as f:
        ckpt = f.read().strip()
    assert osp.isfile(ckpt) and osp.getsize(ckpt) > 0, ckpt
    return ckpt


def _pngs(folder, recursive=False):
    pat = osp.join(str(folder), '**', '*.png') if recursive else osp.join(str(folder), '*.png')
    files = sorted(glob.glob(pat, recursive=recursive))
    for f in files:
        assert osp.getsize(f) > 0, f
    return files


def _dist_env(port):
    # CPU processes over gloo, also on a machine with fewer GPUs than processes
    return dict(PYTHON=sys.executable, PORT=str(port), CUDA_VISIBLE_DEVICES='')


def _state_dict_keys(ckpt):
    import torch

    from linattn_mm.checkpoint import safe_globals
    with safe_globals():  # runner checkpoints hold mmengine HistoryBuffers
        return set(torch.load(ckpt, map_location='cpu', weights_only=True)['state_dict'])


def _backbone_file(name, path):
    """An official-format ``{'model': backbone state dict}`` file of zoo model ``name``."""
    import torch

    import linattn_mm
    os.makedirs(osp.dirname(str(path)) or '.', exist_ok=True)
    torch.manual_seed(0)
    sd = linattn_mm.get_model(name).backbone.state_dict()
    torch.save({'model': sd}, str(path))
    return str(path)


_PRETRAINED = re.compile(r"Pretrained checkpoint '([^']*)' \(state dict from '[^']*'\): "
                         r'(\d+) loaded')


# ------------------------------------------------------------------------------------------------
# the cases
# ------------------------------------------------------------------------------------------------
def case_demo_sh(sh, tmp_path):
    cmd = 'bash tools/demo.sh'
    default = osp.join(CONFIGS, 'polaformer', 'mask-rcnn_pola-nat-tiny_fpn_300it_coco.py')
    train_opts, test_opts, keys = _cfg_options(default, demo=True)
    name = f'mask-rcnn_pola-nat-tiny_fpn_300it_coco_doctest{os.getpid()}'
    config = tmp_path / f'{name}.py'
    # demo.sh gives its extra arguments to train.py only: the tmp config cuts the test pass
    config.write_text(
        f'_base_ = [{default!r}]\n'
        'test_dataloader = dict(dataset=dict(indices=2))\n'
        'model = dict(test_cfg=dict(rpn=dict(nms_pre=200, max_per_img=64), '
        'rcnn=dict(score_thr=0.0)))\n')
    # bootstrap.sh reuses an environment whose stamp matches its STACK: a wrapper of this
    # interpreter with that stamp makes demo.sh run here without ever installing anything
    venv = tmp_path / 'venv'
    (venv / 'bin').mkdir(parents=True)
    # (and should bootstrap.sh not take its reuse path, the wrapper refuses to run pip)
    (venv / 'bin' / 'python').write_text(
        '#!/bin/sh\n'
        'case "$1 $2" in "-m pip") echo "test_doc_commands: pip refused" >&2; exit 97;; esac\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n')
    (venv / 'bin' / 'python').chmod(0o755)
    stack = subprocess.run(
        ['bash', '-c', 'ROOT="$1"; eval "$(grep -m1 "^STACK=" "$1/tools/bootstrap.sh")"; '
         'printf %s "$STACK"', 'bash', REPO], capture_output=True, text=True, check=True).stdout
    assert stack, 'no STACK= line in tools/bootstrap.sh'
    (venv / '.linattn_stack').write_text(stack + '\n')
    work = osp.join(REPO, 'work_dirs', 'demo', name)
    try:
        out = sh(cmd, doc_argv(cmd, append=[str(config), '--cfg-options'] + train_opts),
                 env=dict(LINATTN_VENV=str(venv)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert 'reusing it' in out, out[-3000:]
    assert 'demo finished in' in out, out[-3000:]
    metrics = metrics_of(out)
    for k in keys:
        assert 0.0 <= metrics[k] <= 100.0, (k, metrics)


def case_readme_train_test(sh, tmp_path):
    train = '.venv/bin/python tools/train.py configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py'
    test = ('.venv/bin/python tools/test.py configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py '
            'work_dirs/.../epoch_12.pth')
    test2 = '.venv/bin/python tools/test.py CONFIG CHECKPOINT [--out results.pkl] [--show-dir vis]'
    full = 'configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py'
    train_opts, test_opts, keys = _cfg_options(osp.join(REPO, full), demo=True)
    work = str(tmp_path / 'work')
    out = sh(train, doc_argv(train, append=['--demo', '--work-dir', work, '--cfg-options'] +
                             train_opts))
    assert 'Saving checkpoint' in out
    ckpt = _last_checkpoint(work)
    out = sh(test, doc_argv(test, replace={'work_dirs/.../epoch_12.pth': ckpt},
                            append=['--demo', '--work-dir', work, '--cfg-options'] + test_opts))
    metrics = metrics_of(out)
    assert set(keys) <= set(metrics) and 'coco/bbox_mAP' in metrics, metrics
    for k in keys:
        assert 0.0 <= metrics[k] <= 100.0, (k, metrics)
    pkl = str(tmp_path / 'results.pkl')
    out = sh(test2, doc_argv(test2, replace={'CONFIG': full, 'CHECKPOINT': ckpt},
                             values={'--out': [pkl]},
                             append=['--demo', '--work-dir', work, '--cfg-options'] + test_opts))
    assert 'coco/bbox_mAP' in metrics_of(out)
    assert osp.getsize(pkl) > 0
    drawn = glob.glob(osp.join(work, '*', 'vis', '*'))  # --show-dir: work_dir/timestamp/vis
    assert len(drawn) == 2 and all(osp.getsize(f) > 0 for f in drawn), drawn


def case_readme_dist_train(sh, tmp_path):
    cmd = 'bash tools/dist_train.sh configs/swin/upernet_swin-t_8xb2-160k_ade20k-512x512.py 8'
    full = 'configs/swin/upernet_swin-t_8xb2-160k_ade20k-512x512.py'
    train_opts, _, _ = _cfg_options(osp.join(REPO, full), demo=True)
    work = str(tmp_path / 'work')
    out = sh(cmd, doc_argv(cmd, replace={'8': '2'},
                           append=['--demo', '--work-dir', work, '--cfg-options'] + train_opts),
             env=_dist_env(29531))
    assert 'Saving checkpoint' in out
    keys = _state_dict_keys(_last_checkpoint(work))
    assert any(k.startswith('decode_head.') for k in keys) and any(
        k.startswith('backbone.') for k in keys)


def case_pretrain_finetune(sh, tmp_path):
    pre = 'bash tools/dist_train.sh configs/swin/swin-t_in1k.py 8'
    fine = ('.venv/bin/python tools/train.py configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py '
            '--cfg-options model.backbone.init_cfg.checkpoint=work_dirs/swin-t_in1k/epoch_300.pth')
    cls_full = 'configs/swin/swin-t_in1k.py'
    det_full = 'configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py'
    cls_work, det_work = str(tmp_path / 'in1k'), str(tmp_path / 'det')
    train_opts, _, _ = _cfg_options(osp.join(REPO, cls_full), demo=True)
    sh(pre, doc_argv(pre, replace={'8': '2'},
                     append=['--demo', '--work-dir', cls_work, '--cfg-options'] + train_opts),
       env=_dist_env(29532))
    ckpt = _last_checkpoint(cls_work)
    train_opts, _, _ = _cfg_options(osp.join(REPO, det_full), demo=True)
    out = sh(fine, doc_argv(
        fine,
        values={'--cfg-options': [f'model.backbone.init_cfg.checkpoint={ckpt}',
                                  'model.backbone.init_cfg._delete_=True',
                                  'model.backbone.init_cfg.type=Pretrained'] + train_opts},
        append=['--demo', '--work-dir', det_work]))
    loaded = [m for m in _PRETRAINED.finditer(out) if m.group(1) == ckpt]
    assert loaded and int(loaded[0].group(2)) > 100, out[-3000:]  # the ImageNet backbone loaded
    _last_checkpoint(det_work)


def case_train_compile(sh, tmp_path):
    """The backbone is compiled when training starts (the hook's log line) and the iteration
    trains; the checkpoint has the backbone's usual keys."""
    cmd = 'python tools/train.py CONFIG --compile-backbone aot_eager'
    config = 'configs/polaformer/mask-rcnn_pola-swin-t_fpn_1x_coco.py'
    train_opts, _, _ = _cfg_options(osp.join(REPO, config), demo=True)
    work = str(tmp_path / 'work')
    out = sh(cmd, doc_argv(cmd, replace={'CONFIG': config},
                           append=['--demo', '--work-dir', work, '--cfg-options'] + train_opts))
    assert "The backbone is compiled (torch.compile {'backend': 'aot_eager'})" in out, out[-3000:]
    assert 'Saving checkpoint' in out, out[-3000:]
    assert any(k.startswith('backbone.layers.0.blocks.0.attn.')
               for k in _state_dict_keys(_last_checkpoint(work)))


def case_dist_train_config(sh, tmp_path):
    cmd = 'bash tools/dist_train.sh CONFIG 8'
    config = 'configs/pvtv2/pvtv2-b0_in1k.py'
    train_opts, _, _ = _cfg_options(osp.join(REPO, config), demo=True)
    work = str(tmp_path / 'work')
    out = sh(cmd, doc_argv(cmd, replace={'CONFIG': config, '8': '2'},
                           append=['--demo', '--work-dir', work, '--cfg-options'] + train_opts),
             env=_dist_env(29533))
    assert 'Saving checkpoint' in out
    assert any(k.startswith('backbone.') for k in _state_dict_keys(_last_checkpoint(work)))


def case_get_flops_maskrcnn(sh, tmp_path):
    cmd = '.venv/bin/python tools/get_flops.py configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py'
    out = sh(cmd, doc_argv(cmd))
    # docs/get_started.md: "Mask R-CNN Swin-T counts 47.8M parameters and 273 GMACs at 800x1344"
    # (275 when the window layers projected the padded grid too)
    params = float(re.search(r'^params: ([\d.]+) M', out, re.M).group(1))
    macs = float(re.search(r'^MACs\s*: ([\d.]+) G', out, re.M).group(1))
    assert round(params, 1) == 47.8 and round(macs) == 273, (params, macs)
    assert '[1, 3, 800, 1344]' in out


def case_get_flops_backbone(sh, tmp_path):
    cmd = ('.venv/bin/python tools/get_flops.py '
           'configs/poly/upernet_poly-swin-t_8xb2-160k_ade20k-512x512.py --part backbone')
    out = sh(cmd, doc_argv(cmd))
    assert '[mmseg, backbone, input [1, 3, 512, 512]]' in out
    params = float(re.search(r'^params: ([\d.]+) M', out, re.M).group(1))
    macs = float(re.search(r'^MACs\s*: ([\d.]+) G', out, re.M).group(1))
    assert 20 < params < 30 and macs > 1, (params, macs)


def case_fidelity_report(sh, tmp_path):
    cmd = '.venv/bin/python tools/fidelity_report.py'
    md = tmp_path / 'fidelity.md'
    sh(cmd, doc_argv(cmd, append=['--only', 'swin-t_in1k', '--out', str(md)]))
    text = md.read_text()
    assert text.startswith('# Fidelity report')
    assert '| Config | Paper | Params (M) here / paper |' in text
    assert '| `configs/swin/swin-t_in1k.py` | Swin | 28.29 / 28.3 |' in text


def case_padre_readings(sh, tmp_path):
    import json
    cmd = 'python tools/padre_readings.py'
    js = tmp_path / 'readings.json'
    out = sh(cmd, doc_argv(cmd, append=['--json', str(js)]))
    readings = {r['reading'].split(':')[0]: r for r in json.loads(js.read_text())['readings']}
    # PADRe-2 DeiT-T, as pinned in tests/models/test_padre.py (COMPACT_PARAMS, the full layout's
    # expect of test_deit_t_params_and_flops_next_to_paper)
    compact, full = readings['compact (default)'], readings['full (previous default)']
    assert compact['params']['T-2'] == 5_558_440
    assert full['params']['T-2'] == 6_576_808
    assert compact['table6_macs']['2'] == 548_143_104
    # docs/model_zoo/padre.md: compact is the only reading that fits; Table 6 as 2 x MACs: 1.10
    row = re.search(r'^\| compact \(default\).*$', out, re.M).group(0).split(' | ')
    assert row[2] == '5.56 / 7.18 / 20.85 / 26.74 / 80.62', row
    assert re.fullmatch(r'[\d. /]+ \((\S+) / [\d. /]+\)', row[3]).group(1) == '1.10', row
    assert row[4] == 'yes |', row
    assert 'Table 6 as 2 × MACs: P = 3(d−1), Q = d−1, ratio 4\n' in out, out[-3000:]
    assert 'Table 6 as MACs: none\n' in out, out[-3000:]


def case_browse_dataset(sh, tmp_path):
    cmd = ('.venv/bin/python tools/browse_dataset.py '
           'configs/pvtv2/mask-rcnn_pvtv2-b0_fpn_1x_coco.py --demo --output-dir work_dirs/browse '
           '--max-images 4')
    out_dir = tmp_path / 'browse'
    sh(cmd, doc_argv(cmd, values={'--output-dir': [str(out_dir)]}))
    assert len(_pngs(out_dir)) == 4


VIS_SMALL = ['--size', '64', '--panel', '48', '--entropy-queries', '1']


def _check_attention_out(out_dir, models):
    import json
    assert sorted(osp.basename(f) for f in _pngs(out_dir)) == sorted(
        [f'{m}.png' for m in models] + ['comparison.png'])
    with open(out_dir / 'entropy.json') as f:
        ent = json.load(f)
    assert list(ent['models']) == list(models)
    return ent


def case_visualize_attention(sh, tmp_path):
    cmd = '.venv/bin/python tools/visualize_attention.py --out-dir work_dirs/attention'
    models = ['swin-t_in1k', 'pola-swin-t_in1k']
    out_dir = tmp_path / 'attention'
    out = sh(cmd, doc_argv(cmd, values={'--out-dir': [str(out_dir)]},
                           append=['--models'] + models + VIS_SMALL))
    ent = _check_attention_out(out_dir, models)
    assert ent['image'] == 'generated'
    assert 'entropy' in out and 'of uniform' in out


def case_visualize_attention_checkpoints(sh, tmp_path):
    cmd = ('.venv/bin/python tools/visualize_attention.py --img demo.jpg --query 0.3 0.6 --models '
           'swin-t_in1k pola-swin-t_in1k --checkpoints swin_tiny.pth pola_swin_t.pth')
    import numpy as np
    from PIL import Image
    img = tmp_path / 'demo.jpg'
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)).save(img)
    swin = _backbone_file('swin-t_in1k', tmp_path / 'swin_tiny.pth')
    pola = _backbone_file('pola-swin-t_in1k', tmp_path / 'pola_swin_t.pth')
    out_dir = tmp_path / 'attention'
    sh(cmd, doc_argv(cmd, replace={'demo.jpg': str(img), 'swin_tiny.pth': swin,
                                   'pola_swin_t.pth': pola},
                     append=['--out-dir', str(out_dir)] + VIS_SMALL))
    ent = _check_attention_out(out_dir, ['swin-t_in1k', 'pola-swin-t_in1k'])
    assert ent['image'] == str(img) and ent['query'] == [0.3, 0.6]


_RATIO = r'^{name}\s+{impl}\s+{size}: [\d.]+x  \('


def case_benchmark_attention(sh, tmp_path):
    cmd = ('python tools/benchmark.py --mode attention --grid 128x128 --heads 3 --head-dims 32 '
           '--impls official reference fast --compare official --threads 1 --warmup 2 '
           '--repeats 15')
    out = sh(cmd, doc_argv(cmd, values={'--grid': ['16x16'], '--warmup': ['0'],
                                        '--repeats': ['1']}))
    assert '# time ratios: official / this' in out
    for impl in ('reference', 'fast'):
        assert re.search(_RATIO.format(name=r'pola-attn-qkvg-h3-d32', impl=impl, size='16x16'),
                         out, re.M), out[-3000:]


def case_benchmark_nala_attention(sh, tmp_path):
    cmd = ('python tools/benchmark.py --mode attention --attn nala --grid 128x128 --heads 3 '
           '--head-dims 32 --impls reference fast --compare reference --threads 1 --warmup 2 '
           '--repeats 15')
    out = sh(cmd, doc_argv(cmd, values={'--grid': ['16x16'], '--warmup': ['0'],
                                        '--repeats': ['1']}))
    assert re.search(_RATIO.format(name='nala-attn-h3-d32', impl='fast', size='16x16'), out,
                     re.M), out[-3000:]


def case_benchmark_nala_backbone(sh, tmp_path):
    cmd = ('python tools/benchmark.py --mode backbone nalaformer-t swin-t --sizes 800x1344 '
           '--impls reference fast --threads 1 --warmup 1 --repeats 3 --compare reference '
           'nalaformer-t:swin-t')
    out = sh(cmd, doc_argv(cmd, values={'--sizes': ['64x96'], '--warmup': ['0'],
                                        '--repeats': ['1']}))
    assert '# time ratios: swin-t / this' in out and '# time ratios: reference / this' in out
    for impl in ('reference', 'fast'):
        assert re.search(_RATIO.format(name='nalaformer-t', impl=impl, size='64x96'), out,
                         re.M), out[-3000:]


def case_benchmark_scale_heap(sh, tmp_path):
    import json
    cmd = ('python tools/benchmark.py --mode backbone pola-pvt-t pola-swin-t nalaformer-t-linear '
           '--sizes 1024 2048 --threads 1 --warmup 1 --repeats 2 --heap-malloc --json '
           'scale_heap.json')
    js = tmp_path / 'scale_heap.json'
    out = sh(cmd, tiny_backbone_argv(cmd, json=[str(js)]))
    assert 'heap allocator: on' in out.splitlines()[0] or 'not glibc' in out.splitlines()[0]
    assert json.loads(js.read_text())['args']['heap_malloc'] is True
    for name in ('pola-pvt-t', 'pola-swin-t', 'nalaformer-t-linear'):
        assert re.search(rf'^{name}\s+fast\s+96x96/64x64: [\d.]+; slope', out, re.M), out[-3000:]


def case_benchmark_operations(sh, tmp_path):
    """The counts, the peaks, the bytes and the roofline bounds printed are those of the tables in
    docs/benchmarks.md ("Operations and memory per training step, as on a GPU"), the ratios
    too."""
    cmd = ('python tools/benchmark.py --mode train swin-t pola-swin-t nalaformer-t pvt-t '
           'pola-pvt-t --sizes 800x1344 --device meta --warmup 0 --repeats 1 --compare swin-t '
           'pola-pvt-t:pvt-t --roofline h200')
    out = sh(cmd, doc_argv(cmd))
    with open(osp.join(REPO, 'docs', 'benchmarks.md'), encoding='utf-8') as f:
        doc = f.read()
    row = re.search(r'^\| \+ the residual sums of scaled branches in one pass each way '
                    r'\(\*\*0\.6\.9\*\*, the command above\) \| (\d+) \| \*\*(\d+) \(([\d.]+)×\)\*\* \| '
                    r'\*\*(\d+) \(([\d.]+)×\)\*\* \| (\d+) \| \*\*(\d+) \(([\d.]+)×\)\*\* \|$',
                    doc, re.M)
    assert row, 'the 0.6.9 row of the operations table'
    swin, pola, r_pola, nala, r_nala, pvt, pola_pvt, r_pvt = row.groups()
    mem = re.search(r'^\| meta, 0\.6\.9, batch 1 \| ([\d.]+) MB \| ([\d.]+) MB \(([\d.]+)×\) \| '
                    r'([\d.]+) MB \(([\d.]+)×\) \| ([\d.]+) MB \| ([\d.]+) MB \(([\d.]+)× PVT-T', doc,
                    re.M)
    assert mem, 'the batch-1 row of the memory table'
    cells = r' \| ([\d.]+)(?: ms)?(?: \(([\d.]+)×(?: PVT-T\'s)?\))?'
    moved = re.search(r'^\| GB moved, batch 1, \*\*0\.6\.9\*\*' + cells * 5 + r' \|$', doc, re.M)
    bound = re.search(r'^\| roofline H200, batch 1, \*\*0\.6\.9\*\*' + cells * 5 + r' \|$', doc,
                      re.M)
    assert moved and bound, 'the batch-1 rows of the bytes table'
    names = ('swin-t', 'pola-swin-t', 'nalaformer-t', 'pvt-t', 'pola-pvt-t')
    peaks = dict(zip(names, mem.group(1, 2, 4, 6, 7)))
    gbs = dict(zip(names, moved.group(1, 3, 5, 7, 9)))
    ms = dict(zip(names, bound.group(1, 3, 5, 7, 9)))
    for name, n in zip(names, (swin, pola, nala, pvt, pola_pvt)):
        assert re.search(rf'^{name}\s+\S+\s+800x1344\s+{n} ops  peak\s+{peaks[name]} MB\s+'
                         rf'{gbs[name]} GB moved\s+[\d.]+ TFLOP  roofline h200 {ms[name]} ms$', out,
                         re.M), (name, out[-3000:])
    for name, n, base, r, m, i in (('pola-swin-t', pola, swin, r_pola, mem.group(3), 4),
                                   ('nalaformer-t', nala, swin, r_nala, mem.group(5), 6),
                                   ('pola-pvt-t', pola_pvt, pvt, r_pvt, mem.group(8), 10)):
        assert f'800x1344: operations {r}x ({n} / {base})' in out, (name, out[-3000:])
        assert re.search(rf'^{name}\s.*800x1344: operations {r}x \({n} / {base}\); bytes '
                         rf'{moved.group(i)}x; roofline {bound.group(i)}x; memory {m}x', out,
                         re.M), (name, out[-3000:])


def _check_triton_table(sh, cmd, header, cols, bases):
    """Run doc command ``cmd`` and check the batch-1 rows of the docs/benchmarks.md table whose
    header row starts with ``header`` against its output: per column (target, impl) the
    operations, peak, GB moved and roofline bound, and for the targets in ``bases`` (target ->
    baseline column index) the ratios. The batch-8 rows come from the same command with
    ``--batch 8``."""
    with open(osp.join(REPO, 'docs', 'benchmarks.md'), encoding='utf-8') as f:
        doc = f.read()
    table = doc[doc.index(header):]
    table = table[:table.index('\n\n')]
    cell = r' \| \**([\d.]+)(?: ms| MB)?(?: \(([\d.]+)×(?: PVT-T\'s)?\))?\**'
    rows = {}
    for what in ('operations', 'GB moved', 'roofline H200', 'peak'):
        m = re.search(rf'^\| {what}, batch 1' + cell * len(cols) + r' \|$', table, re.M)
        assert m, what
        rows[what] = m.groups()
    out = sh(cmd, doc_argv(cmd))
    for i, (name, impl) in enumerate(cols):
        ops, gb, ms, mb = (rows[w][2 * i] for w in ('operations', 'GB moved', 'roofline H200',
                                                    'peak'))
        assert re.search(rf'^{name}\s+{impl}\s+800x1344\s+{ops} ops  peak\s+{mb} MB\s+'
                         rf'{gb} GB moved\s+[\d.]+ TFLOP  roofline h200 {ms} ms$', out,
                         re.M), (name, impl, out[-3000:])
        if name not in bases:
            continue
        r_ops, r_gb, r_ms, r_mb = (rows[w][2 * i + 1] for w in ('operations', 'GB moved',
                                                                'roofline H200', 'peak'))
        base_ops = rows['operations'][2 * bases[name]]
        assert re.search(rf'^{name}\s+{impl}\s+800x1344: operations {r_ops}x \({ops} / '
                         rf'{base_ops}\); bytes {r_gb}x; roofline {r_ms}x; memory {r_mb}x',
                         out, re.M), (name, impl, out[-3000:])


def case_benchmark_triton_operations(sh, tmp_path):
    """The operations, bytes, roofline bounds and peaks of the torch and Triton Pola cores printed
    are those of the batch-1 rows of the Pola table in docs/benchmarks.md ("The Triton training
    kernels of the Pola and NaLa cores"), the ratios too."""
    _check_triton_table(
        sh, 'python tools/benchmark.py --mode train swin-t pola-swin-t pvt-t pola-pvt-t --sizes '
        '800x1344 --device meta --warmup 0 --repeats 1 --impls fast triton --compare swin-t '
        'pola-pvt-t:pvt-t --roofline h200',
        '| float32 training step, 800×1344 | Swin-T (stock) | Pola-Swin-T, torch core',
        (('swin-t', '-'), ('pola-swin-t', 'fast'), ('pola-swin-t', 'triton'), ('pvt-t', '-'),
         ('pola-pvt-t', 'fast'), ('pola-pvt-t', 'triton')),
        {'pola-swin-t': 0, 'pola-pvt-t': 3})


def case_benchmark_triton_nala_operations(sh, tmp_path):
    """The same for the NaLa table (NaLaFormer-T, and with NaLa in all stages)."""
    _check_triton_table(
        sh, 'python tools/benchmark.py --mode train swin-t nalaformer-t nalaformer-t-linear '
        '--sizes 800x1344 --device meta --warmup 0 --repeats 1 --impls fast triton --compare '
        'swin-t --roofline h200',
        '| float32 training step, 800×1344 | Swin-T (stock) | NaLaFormer-T, torch core',
        (('swin-t', '-'), ('nalaformer-t', 'fast'), ('nalaformer-t', 'triton'),
         ('nalaformer-t-linear', 'fast'), ('nalaformer-t-linear', 'triton')),
        {'nalaformer-t': 0, 'nalaformer-t-linear': 0})


def case_benchmark_bf16_operations(sh, tmp_path):
    """The same for the bf16 table ("Under autocast"): the steps counted under CUDA's autocast
    on meta, the torch and Triton cores of the three linear backbones and the two stock ones."""
    _check_triton_table(
        sh, 'python tools/benchmark.py --mode train swin-t pola-swin-t nalaformer-t pvt-t '
        'pola-pvt-t --sizes 800x1344 --device meta --dtype bf16 --warmup 0 --repeats 1 --impls '
        'fast triton --compare swin-t pola-pvt-t:pvt-t --roofline h200',
        '| bf16 training step, 800×1344 | Swin-T (stock) | Pola-Swin-T, torch core',
        (('swin-t', '-'), ('pola-swin-t', 'fast'), ('pola-swin-t', 'triton'),
         ('nalaformer-t', 'fast'), ('nalaformer-t', 'triton'), ('pvt-t', '-'),
         ('pola-pvt-t', 'fast'), ('pola-pvt-t', 'triton')),
        {'pola-swin-t': 0, 'nalaformer-t': 0, 'pola-pvt-t': 5})


def case_benchmark_fused_pola_operations(sh, tmp_path):
    """The same for the fused cores' Pola table ("The fused cores"): the torch, fused and Triton
    Pola cores of Pola-Swin-T and Pola-PVT-T and the two stock backbones, under autocast."""
    _check_triton_table(
        sh, 'python tools/benchmark.py --mode train swin-t pola-swin-t pvt-t pola-pvt-t --sizes '
        '800x1344 --device meta --dtype bf16 --warmup 0 --repeats 1 --impls fast fused triton '
        '--compare swin-t pola-pvt-t:pvt-t --roofline h200',
        '| bf16 training step, 800×1344, fused cores | Swin-T (stock) | Pola-Swin-T, torch core',
        (('swin-t', '-'), ('pola-swin-t', 'fast'), ('pola-swin-t', 'fused'),
         ('pola-swin-t', 'triton'), ('pvt-t', '-'), ('pola-pvt-t', 'fast'),
         ('pola-pvt-t', 'fused'), ('pola-pvt-t', 'triton')),
        {'pola-swin-t': 0, 'pola-pvt-t': 4})


def case_benchmark_fused_nala_operations(sh, tmp_path):
    """The same for the fused cores' NaLa table (NaLaFormer-T)."""
    _check_triton_table(
        sh, 'python tools/benchmark.py --mode train swin-t nalaformer-t --sizes 800x1344 --device '
        'meta --dtype bf16 --warmup 0 --repeats 1 --impls fast fused triton --compare swin-t '
        '--roofline h200',
        '| bf16 training step, 800×1344, fused cores | Swin-T (stock) | NaLaFormer-T, torch core',
        (('swin-t', '-'), ('nalaformer-t', 'fast'), ('nalaformer-t', 'fused'),
         ('nalaformer-t', 'triton')),
        {'nalaformer-t': 0})


def case_benchmark_ops_by_module(sh, tmp_path):
    """The table "Where the operations are": each cell is a line of the command's output (module,
    phase, operations), each column header the step's total; and the sums of the text below it
    (NaLaFormer-T's blocks, softmax and NaLa layers, forward and backward; their numbers)."""
    cmd = ('python tools/benchmark.py --mode train swin-t pola-swin-t nalaformer-t --sizes '
           '800x1344 --device meta --dtype bf16 --warmup 0 --repeats 1 --impls triton '
           '--ops-by-module 8 --compare swin-t')
    with open(osp.join(REPO, 'docs', 'benchmarks.md'), encoding='utf-8') as f:
        doc = f.read()
    table = doc[doc.index('| bf16, batch 1, 800×1344 | Swin-T (stock): '):]
    table = table[:table.index('\n\n')]
    out = sh(cmd, doc_argv(cmd))
    totals = re.findall(r': (\d+) \|', table.splitlines()[0])
    rows = table.splitlines()[2:]
    assert len(totals) == 3 and len(rows) == 8, table
    blocks = re.split(r'^(?=\S)', out, flags=re.M)
    for col, (name, impl) in enumerate((('swin-t', '-'), ('pola-swin-t', 'triton'),
                                        ('nalaformer-t', 'triton'))):
        (block, ) = [b for b in blocks if re.match(rf'{name}\s+{re.escape(impl)}\s+800x1344\s+'
                                                     rf'{totals[col]} ops', b)]
        listed = re.findall(r'^    (\S+)\s+(forward|backward)\s+(\d+) ops', block, re.M)
        cells = [re.fullmatch(r'`(\S+)` (forward|backward): (\d+)',
                              row.strip().strip('|').split('|')[col + 1].strip()).groups()
                 for row in rows]
        assert cells == listed, (name, cells, listed)
    nala = {(m, p): int(n) for m, p, n in cells}  # the last column's
    text = doc[doc.index(table):]
    text = ' '.join(text[text.index('NaLaFormer-T\'s operations are'):].split('\n\n')[0].split())
    for module, count, what in (('NaLaBlock', 'twelve', 'blocks'),
                                ('NaLaSoftmaxAttention', 'eight', 'softmax layers'),
                                ('NormAwareLinearAttention', 'four', 'NaLa layers')):
        both = nala[(module, 'forward')] + nala[(module, 'backward')]
        assert f'{count} {what}' in text and f'{both}' in text, (module, both, text)
    from linattn_mm.models.attentions.nala import NaLaSoftmaxAttention, NormAwareLinearAttention
    from linattn_mm.models.backbones.nalaformer import NaLaBlock
    import runpy
    tool = runpy.run_path(osp.join(REPO, 'tools', 'benchmark.py'), run_name='linattn_benchmark')
    model = tool['build_backbone']('nalaformer-t')
    assert [sum(isinstance(m, c) for m in model.modules()) for c in (
        NaLaBlock, NaLaSoftmaxAttention, NormAwareLinearAttention)] == [12, 8, 4]


def case_benchmark_train_backbones(sh, tmp_path):
    cmd = ('python tools/benchmark.py --mode train pola-swin-t swin-t nalaformer-t '
           'nalaformer-t-linear linattn-swin-t --sizes 800x1344 --batch 1 --threads 1 --warmup 1 '
           '--repeats 5 --compare swin-t pola-swin-t:linattn-swin-t')
    out = sh(cmd, doc_argv(cmd, values={'--sizes': ['64x96'], '--warmup': ['0'],
                                        '--repeats': ['1']}))
    assert '# time ratios: swin-t / this' in out
    assert '# time ratios: linattn-swin-t / this' in out
    for name in ('pola-swin-t', 'nalaformer-t', 'nalaformer-t-linear', 'linattn-swin-t'):
        assert re.search(_RATIO.format(name=name, impl=r'\S+', size='64x96'), out, re.M), \
            out[-3000:]
    assert re.search(r'^pola-swin-t\s+fast\s+64x96: [\d.]+x  \(.*memory [\d.]+x', out, re.M), \
        out[-3000:]


def case_benchmark_train_pvt(sh, tmp_path):
    cmd = ('python tools/benchmark.py --mode train pola-pvt-t pvt-t linattn-pvt-t --sizes 512x832 '
           '800x1344 --threads 1 --warmup 1 --repeats 5 --compare pvt-t pola-pvt-t:linattn-pvt-t')
    out = sh(cmd, doc_argv(cmd, values={'--sizes': ['64x96', '96x128'], '--warmup': ['0'],
                                        '--repeats': ['1']}))
    for size in ('64x96', '96x128'):
        for name in ('pola-pvt-t', 'linattn-pvt-t'):
            assert re.search(_RATIO.format(name=name, impl=r'\S+', size=size), out, re.M), \
                out[-3000:]
    assert '# time ratios: linattn-pvt-t / this' in out


def case_benchmark_train_mask_rcnn(sh, tmp_path):
    stock = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'
    ours = 'configs/polaformer/mask-rcnn_pola-swin-t_fpn_1x_coco.py'
    cmd = (f"python tools/benchmark.py --mode train {ours} '{stock}' --part model --sizes 800x1344 "
           f"--threads 1 --warmup 1 --repeats 3 --compare '{stock}'")
    out = sh(cmd, doc_argv(cmd, values={'--sizes': ['128x192'], '--warmup': ['0'],
                                        '--repeats': ['1']}))
    assert f'# time ratios: {stock} / this' in out
    assert re.search(_RATIO.format(name=re.escape(ours), impl=r'\S+', size='128x192'), out,
                     re.M), out[-3000:]


def _gpu_cmd(key_start):
    """The TABLE key (a docs/benchmarks.md GPU command) that starts with ``key_start``."""
    (cmd, ) = [c for c in TABLE if c.startswith(key_start) and '--device cuda' in c]
    return cmd


def case_gpu_benchmark_core(sh, tmp_path):
    cmd = _gpu_cmd('python tools/benchmark.py --mode core --attn pola')
    out = sh(cmd, doc_argv(cmd, values={'--device': ['cpu'], '--dtype': ['fp32'],
                                        '--impls': ['torch', 'reference'],
                                        '--compare': ['reference'], '--grid': ['8x8'],
                                        '--batch': ['1'], '--warmup': ['0'], '--repeats': ['1']}))
    assert re.search(r'^pola-core-h3-d32 reference B1 8x8 fp32: +[\d.]+ ms .* MiB moved at '
                     r'least, +[\d.]+ GB/s', out, re.M), out[-3000:]
    assert re.search(r'^  torch vs reference: [\d.]+x$', out, re.M), out[-3000:]


def case_gpu_benchmark_backbone(sh, tmp_path):
    cmd = _gpu_cmd('python tools/benchmark.py --mode backbone')
    out = sh(cmd, doc_argv(cmd, values={'--device': ['cpu'], '--dtype': ['fp32'],
                                        '--sizes': ['64x96'], '--batch': ['1'],
                                        '--warmup': ['0'], '--repeats': ['1']}))
    for base, name in (('swin-t', 'pola-swin-t'), ('swin-t', 'nalaformer-t'),
                       ('pvt-t', 'pola-pvt-t')):
        assert f'# time ratios: {base} / this' in out
        for impl in ('fast', 'torch'):
            assert re.search(_RATIO.format(name=name, impl=impl, size='64x96'), out, re.M), \
                out[-3000:]


_GPU_TRAIN = ('python tools/benchmark.py --mode train pola-swin-t nalaformer-t swin-t '
              'linattn-swin-t pola-pvt-t pvt-t --device cuda ')


def case_gpu_benchmark_train(sh, tmp_path):
    _gpu_train_case(sh, _gpu_cmd(_GPU_TRAIN + '--dtype bf16'), 'bf16')


def case_gpu_benchmark_train_fp32(sh, tmp_path):
    _gpu_train_case(sh, _gpu_cmd(_GPU_TRAIN + '--sizes'), 'fp32')


def _gpu_train_case(sh, cmd, dtype):
    out = sh(cmd, doc_argv(cmd, values={'--device': ['cpu'], '--sizes': ['64x96'],
                                        '--batch': ['1'], '--warmup': ['0'], '--repeats': ['1']}))
    assert f'dtype {dtype}' in out and 'FAILED' not in out, out[-3000:]
    for base, name in (('swin-t', 'pola-swin-t'), ('swin-t', 'nalaformer-t'),
                       ('swin-t', 'linattn-swin-t'), ('pvt-t', 'pola-pvt-t')):
        assert f'# time ratios: {base} / this' in out
        assert re.search(_RATIO.format(name=name, impl=r'\S+', size='64x96'), out, re.M), \
            out[-3000:]


def case_gpu_benchmark_train_h200(sh, tmp_path):
    cmd = _gpu_cmd('python tools/benchmark.py --mode train swin-t pola-swin-t')
    out = sh(cmd, doc_argv(cmd, values={'--device': ['cpu'], '--sizes': ['64x96'],
                                        '--batch': ['1'], '--warmup': ['0'], '--repeats': ['1']}))
    assert 'dtype bf16' in out and 'FAILED' not in out, out[-3000:]
    for base, name in (('swin-t', 'pola-swin-t'), ('swin-t', 'nalaformer-t'),
                       ('pvt-t', 'pola-pvt-t')):
        assert f'# time ratios: {base} / this' in out
        assert re.search(_RATIO.format(name=name, impl='fast', size='64x96'), out, re.M), \
            out[-3000:]


def case_gpu_benchmark_train_mask_rcnn(sh, tmp_path):
    stock = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'
    cmd = _gpu_cmd('python tools/benchmark.py --mode train configs/polaformer/')
    out = sh(cmd, doc_argv(cmd, values={'--device': ['cpu'], '--sizes': ['128x192'],
                                        '--batch': ['1'], '--warmup': ['0'], '--repeats': ['1']}))
    assert f'# time ratios: {stock} / this' in out
    for ours in ('configs/polaformer/mask-rcnn_pola-swin-t_fpn_1x_coco.py',
                 'configs/nalaformer/mask-rcnn_nalaformer-t_fpn_1x_coco.py'):
        assert re.search(_RATIO.format(name=re.escape(ours), impl=r'\S+', size='128x192'), out,
                         re.M), out[-3000:]


def case_benchmark_train_scale(sh, tmp_path):
    cmd = ('python tools/benchmark.py --mode train pola-pvt-t pola-swin-t nalaformer-t-linear '
           'configs/padre/mask-rcnn_padre-swin-t_fpn_1x_coco.py '
           'configs/poly/mask-rcnn_poly-pvt-t_fpn_1x_coco.py --sizes 1024 2048 --threads 1 '
           '--warmup 0 --repeats 1')
    out = sh(cmd, doc_argv(cmd, values={'--sizes': ['64', '96']}))
    for name in ('pola-pvt-t', 'pola-swin-t', 'nalaformer-t-linear',
                 'configs/padre/mask-rcnn_padre-swin-t_fpn_1x_coco.py',
                 'configs/poly/mask-rcnn_poly-pvt-t_fpn_1x_coco.py'):
        assert re.search(rf'^{re.escape(name)}\s+\S+\s+96x96/64x64: [\d.]+; slope [-\d.]+ '
                         rf'\(memory [\d.]+\)', out, re.M), out[-3000:]


def case_benchmark_train_padre_poly(sh, tmp_path):
    padre = 'configs/padre/mask-rcnn_padre-swin-t_fpn_1x_coco.py'
    poly = 'configs/poly/mask-rcnn_poly-pvt-t_fpn_1x_coco.py'
    cmd = (f'python tools/benchmark.py --mode train {padre} {poly} swin-t pvt-t --sizes 800x1344 '
           f'--threads 1 --warmup 1 --repeats 3 --compare swin-t {poly}:pvt-t')
    out = sh(cmd, doc_argv(cmd, values={'--sizes': ['64x96'], '--warmup': ['0'],
                                        '--repeats': ['1']}))
    assert '# time ratios: swin-t / this' in out and '# time ratios: pvt-t / this' in out
    for name in (padre, poly):
        assert re.search(_RATIO.format(name=re.escape(name), impl=r'\S+', size='64x96'), out,
                         re.M), out[-3000:]


def case_benchmark_train_bf16(sh, tmp_path):
    cmd = ('python tools/benchmark.py --mode train pola-swin-t nalaformer-t swin-t linattn-swin-t '
           '--sizes 800x1344 --threads 1 --warmup 1 --repeats 1 --dtype bf16 --compare swin-t')
    out = sh(cmd, doc_argv(cmd, values={'--sizes': ['64x96'], '--warmup': ['0']}))
    assert 'dtype bf16' in out.splitlines()[0] or 'dtype bf16' in out, out[:2000]
    for name in ('pola-swin-t', 'nalaformer-t', 'linattn-swin-t'):
        assert re.search(rf'^{name}\s+\S+\s+64x96: [\d.]+x  \(.*memory [\d.]+x', out, re.M), \
            out[-3000:]


def case_benchmark_train_scale_setformer(sh, tmp_path):
    cfg = 'configs/setformer/mask-rcnn_setformer-t_fpn_1x_coco.py'
    cmd = (f'python tools/benchmark.py --mode train {cfg} --sizes 1024 2048 --threads 1 --warmup 0 '
           '--repeats 1')
    out = sh(cmd, doc_argv(cmd, values={'--sizes': ['64', '96']}))
    assert re.search(rf'^{re.escape(cfg)}\s+\S+\s+96x96/64x64: [\d.]+; slope', out, re.M), \
        out[-3000:]


def case_benchmark_core(sh, tmp_path):
    cmd = ('python tools/benchmark.py --mode core --device cuda --dtype bf16 --grid 128x128 '
           '256x256 --batch 8 --impls triton torch --compare torch')
    out = sh(cmd, doc_argv(cmd, values={'--device': ['cpu'], '--dtype': ['fp32'],
                                        '--impls': ['torch', 'reference'],
                                        '--compare': ['reference'], '--grid': ['8x8'],
                                        '--batch': ['1']}))
    assert re.search(r'^pola-core-h3-d32 torch\s+B1 8x8 fp32: +[\d.]+ ms .* MiB moved at least, '
                     r'+[\d.]+ GB/s', out, re.M), out[-3000:]
    assert re.search(r'^  torch vs reference: [\d.]+x$', out, re.M), out[-3000:]


def case_benchmark_nala_core(sh, tmp_path):
    cmd = ('python tools/benchmark.py --mode core --attn nala --device cuda --dtype bf16 --grid '
           '128x128 256x256 --batch 8 --impls triton torch --compare torch')
    out = sh(cmd, doc_argv(cmd, values={'--device': ['cpu'], '--dtype': ['fp32'],
                                        '--impls': ['torch', 'reference'],
                                        '--compare': ['reference'], '--grid': ['8x8'],
                                        '--batch': ['1']}))
    assert re.search(r'^nala-core-h3-d32 torch\s+B1 8x8 fp32: +[\d.]+ ms .* MiB moved at least, '
                     r'+[\d.]+ GB/s', out, re.M), out[-3000:]
    assert re.search(r'^  torch vs reference: [\d.]+x$', out, re.M), out[-3000:]


def case_benchmark_model(sh, tmp_path):
    cmd = ('python tools/benchmark.py --mode model configs/polaformer/pola-pvt-t_in1k.py '
           'configs/polaformer/pola-swin-t_in1k.py --sizes 224 --batch 8 --impls official fast '
           '--compare official --threads 1 --warmup 1 --repeats 7')
    out = sh(cmd, doc_argv(cmd, values={'--sizes': ['64'], '--batch': ['1'], '--warmup': ['0'],
                                        '--repeats': ['1']}))
    for cfg in ('pola-pvt-t_in1k', 'pola-swin-t_in1k'):
        assert re.search(_RATIO.format(name=re.escape(f'configs/polaformer/{cfg}.py'),
                                       impl='fast', size='64x64'), out, re.M), out[-3000:]


def case_benchmark_backbone(sh, tmp_path):
    cmd = ('python tools/benchmark.py --mode backbone pola-swin-t swin-t linattn-swin-t pola-pvt-t '
           'pvt-t linattn-pvt-t nalaformer-t nalaformer-t-linear --sizes 800x1344 --threads 1 '
           '--warmup 1 --repeats 3 --compare pola-swin-t:swin-t linattn-swin-t:swin-t '
           'pola-swin-t:linattn-swin-t pola-pvt-t:pvt-t pola-pvt-t:linattn-pvt-t '
           'nalaformer-t:swin-t nalaformer-t-linear:swin-t')
    out = sh(cmd, doc_argv(cmd, values={'--sizes': ['64x96'], '--warmup': ['0'],
                                        '--repeats': ['1']}))
    for base, name in (('swin-t', 'pola-swin-t'), ('swin-t', 'linattn-swin-t'),
                       ('linattn-swin-t', 'pola-swin-t'), ('pvt-t', 'pola-pvt-t'),
                       ('linattn-pvt-t', 'pola-pvt-t'), ('swin-t', 'nalaformer-t'),
                       ('swin-t', 'nalaformer-t-linear')):
        assert f'# time ratios: {base} / this' in out
        assert re.search(_RATIO.format(name=name, impl=r'\S+', size='64x96'), out, re.M), \
            out[-3000:]


def case_benchmark_scale(sh, tmp_path):
    import json
    cmd = ('python tools/benchmark.py --mode backbone pola-pvt-t pola-swin-t nalaformer-t-linear '
           '--sizes 1024 2048 --threads 1 --warmup 1 --repeats 2 --json scale.json '
           '--plot scale.png')
    js, png = tmp_path / 'scale.json', tmp_path / 'scale.png'
    out = sh(cmd, tiny_backbone_argv(cmd, json=[str(js)], plot=[str(png)]))
    assert png.stat().st_size > 1000
    text = json.dumps(json.loads(js.read_text()))
    for name in ('pola-pvt-t', 'pola-swin-t', 'nalaformer-t-linear'):
        assert re.search(rf'^{name}\s+fast\s+96x96/64x64: [\d.]+; slope', out, re.M), out[-3000:]
        assert f'"{name}' in text
    assert '"latency_ms"' in text


def case_benchmark_scale_softmax(sh, tmp_path):
    cmd = ('python tools/benchmark.py --mode backbone nalaformer-t pvt-t --sizes 1024 2048 '
           '--threads 1 --warmup 1 --repeats 2')
    out = sh(cmd, tiny_backbone_argv(cmd))
    for name in ('nalaformer-t', 'pvt-t'):
        assert re.search(rf'^{name}\s+\S+\s+96x96/64x64: [\d.]+; slope', out, re.M), out[-3000:]


def case_benchmark_global(sh, tmp_path):
    cmd = ('python tools/benchmark.py --mode backbone global-pvt-t pola-pvt-t --sizes 256 512 '
           '--threads 1 --warmup 1 --repeats 2')
    out = sh(cmd, tiny_backbone_argv(cmd))
    for name in ('global-pvt-t', 'pola-pvt-t'):
        for size in ('64x64', '96x96'):
            assert re.search(rf'^{name}\s+\S+\s+{size}\s+[\d.]+ ms', out, re.M), out[-3000:]


def _doc_python_block(doc, first_line):
    """The python block of ``doc`` whose first line is ``first_line``."""
    with open(osp.join(REPO, doc), encoding='utf-8') as f:
        text = f.read()
    for block in re.findall(r'^```python\n(.*?)^```', text, re.M | re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f'{doc}: no python block starting with {first_line!r}')


def case_new_detector_config(sh, tmp_path):
    cmd = '.venv/bin/python tools/train.py configs/mine/atss_swin-t_fpn_1x_coco.py'
    rel = 'configs/mine/atss_swin-t_fpn_1x_coco.py'
    block = _doc_python_block('docs/new_detector_config.md', f'# {rel}\n')
    stock_base = "_base_ = ['mmdet::atss/atss_r50_fpn_1x_coco.py']"
    assert stock_base in block, 'the doc config no longer inherits the stock ATSS config'
    cfg = tmp_path / rel
    cfg.parent.mkdir(parents=True)
    cfg.write_text(block)
    # the demo data where --demo reads it: data/demo of the working directory
    (tmp_path / 'data').mkdir()
    os.symlink(osp.join(REPO, 'data', 'demo'), tmp_path / 'data' / 'demo')
    ckpt = re.search(r"checkpoint='([^']+)'", block).group(1)
    _backbone_file('swin-t_in1k', tmp_path / ckpt)
    train_opts, _, _ = _cfg_options(str(cfg), demo=True)
    # the demo overlay trains from scratch (init_cfg=None): the doc's pretrained file is put back
    pretrained = ['model.backbone.init_cfg._delete_=True',
                  'model.backbone.init_cfg.type=Pretrained',
                  f'model.backbone.init_cfg.checkpoint={ckpt}']
    out = sh(cmd, doc_argv(cmd, replace={'tools/train.py': osp.join(REPO, 'tools', 'train.py')},
                           append=['--demo', '--cfg-options'] + pretrained + train_opts),
             cwd=str(tmp_path))
    assert 'loss_centerness' in out and 'Saving checkpoint' in out, out[-3000:]
    loaded = [m for m in _PRETRAINED.finditer(out) if m.group(1) == ckpt]
    assert loaded and int(loaded[0].group(2)) > 100, out[-3000:]
    _last_checkpoint(str(tmp_path / 'work_dirs' / 'atss_swin-t_fpn_1x_coco_demo'))


def case_demo_overlay(sh, tmp_path):
    data = '.venv/bin/python tools/make_demo_data.py'
    train = '.venv/bin/python tools/train.py configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py --demo'
    test = ('.venv/bin/python tools/test.py configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py '
            'work_dirs/mask-rcnn_swin-t_fpn_1x_coco_demo/epoch_12.pth --demo')
    out = sh(data, doc_argv(data))
    for task in ('coco', 'ade', 'imagenet'):
        assert f'{task}: skipped (up to date)' in out, out[-3000:]
    config = osp.join(REPO, 'configs', 'swin', 'mask-rcnn_swin-t_fpn_1x_coco.py')
    train_opts, test_opts, keys = _cfg_options(config, demo=True)
    work = str(tmp_path / 'work')
    out = sh(train, doc_argv(train, append=['--work-dir', work, '--cfg-options'] + train_opts))
    assert 'Saving checkpoint' in out
    ckpt = _last_checkpoint(work)
    out = sh(test, doc_argv(
        test, replace={'work_dirs/mask-rcnn_swin-t_fpn_1x_coco_demo/epoch_12.pth': ckpt},
        append=['--work-dir', work, '--cfg-options'] + test_opts))
    metrics = metrics_of(out)
    for k in keys:
        assert 0.0 <= metrics[k] <= 100.0, (k, metrics)


def case_demo_config_mim(sh, tmp_path):
    write = ('.venv/bin/python -m linattn_mm.demo configs/swin/mask-rcnn_swin-t_fpn_1x_coco.py -o '
             'work_dirs/mask-rcnn_swin-t_fpn_1x_coco_demo.py')
    train = 'mim train mmdet work_dirs/mask-rcnn_swin-t_fpn_1x_coco_demo.py --gpus 0'
    try:
        import mim  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the environment
        pytest.skip(f'openmim is not importable ({type(e).__name__}: {e}); tools/bootstrap.sh '
                    'installs it')
    doc_file = 'work_dirs/mask-rcnn_swin-t_fpn_1x_coco_demo.py'
    demo = str(tmp_path / 'mask-rcnn_swin-t_fpn_1x_coco_demo.py')
    out = sh(write, doc_argv(write, replace={doc_file: demo}))
    assert demo in out.splitlines()
    train_opts, _, _ = _cfg_options(demo)
    work = str(tmp_path / 'work')
    # mim runs mmdet's tools/train.py with the `python` first on PATH: this interpreter's
    path = osp.dirname(sys.executable) + os.pathsep + os.environ.get('PATH', '')
    out = sh(train, doc_argv(train, replace={doc_file: demo},
                             append=['--work-dir', work, '--cfg-options'] + train_opts),
             env=dict(PATH=path))
    assert 'Saving checkpoint' in out, out[-3000:]
    _last_checkpoint(work)


CASES = {name[len('case_'):]: fn for name, fn in globals().items() if name.startswith('case_')}


# ------------------------------------------------------------------------------------------------
# the tests
# ------------------------------------------------------------------------------------------------
DOC_COMMANDS = extract_commands()


def _where(cmd):
    return [f'{f}:{line}' for f, line, c in DOC_COMMANDS if c == cmd]


def _case_id(case):
    locs = []
    for cmd, entry in TABLE.items():
        if isinstance(entry, Run) and entry.case == case:
            locs += [osp.basename(w) for w in _where(cmd)] or [f'{case}(not in docs)']
    return '+'.join(locs)


def test_table_covers_every_doc_command():
    missing = [(f, line, c) for f, line, c in DOC_COMMANDS if c not in TABLE]
    msgs = [f'{f}:{line}: the command\n    {c}\n  is not in TABLE of tests/e2e/test_doc_commands.py. '
            f'Add it there: {c!r}: Run(CASE, HOW) with a case_CASE function that runs it via '
            f'doc_argv() (substitutions listed in HOW), or {c!r}: Exempt(REASON) if it cannot '
            f'run in a test.' for f, line, c in missing]
    stale = sorted(set(TABLE) - {c for _, _, c in DOC_COMMANDS})
    msgs += [f'TABLE entry for a command no doc has any more (remove it and its case code):\n'
             f'    {c}' for c in stale]
    assert not msgs, '\n'.join(msgs)
    assert {c for _, _, c in DOC_COMMANDS} == set(TABLE)


def test_extraction_sees_labelled_and_unlabelled_blocks():
    """The extractor itself: shell blocks, unlabelled command blocks, continuations, comments;
    unlabelled formula / listing blocks and python blocks are not commands."""
    files = {f for f, _, _ in DOC_COMMANDS}
    assert {'README.md', 'docs/get_started.md', 'docs/benchmarks.md',
            'docs/new_detector_config.md'} <= files
    text = '\n'.join(['```bash', 'bash a.sh x \\', '    --y 1   # note', '# only a comment',
                      'FOO=1 BAR=x bash b.sh', '```', '```', 'data/coco/x.json', '```', '```',
                      'python tools/t.py --a \\', '  --b', '```', '```python', 'import x', '```',
                      '~~~sh', 'mim train mmdet C', '~~~'])
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        with open(osp.join(d, 'README.md'), 'w') as f:
            f.write(text)
        got = extract_commands(d)
    assert got == [('README.md', 2, 'bash a.sh x --y 1'),
                   ('README.md', 5, 'FOO=1 BAR=x bash b.sh'),
                   ('README.md', 11, 'python tools/t.py --a --b'),
                   ('README.md', 18, 'mim train mmdet C')], got


def test_every_case_is_used_and_every_run_entry_has_a_case():
    used = {e.case for e in TABLE.values() if isinstance(e, Run)}
    assert used == set(CASES), (used ^ set(CASES))


@pytest.mark.parametrize('case', sorted(CASES), ids=[_case_id(c) for c in sorted(CASES)])
def test_doc_command_runs(case, demo_data, tmp_path):
    sh = Shell()
    CASES[case](sh, tmp_path)
    expected = [c for c, e in TABLE.items() if isinstance(e, Run) and e.case == case]
    assert sorted(sh.ran) == sorted(expected), (
        f'case {case} ran {sh.ran}, but TABLE assigns it {expected}')
