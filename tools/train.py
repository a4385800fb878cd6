"""Train any mmdet / mmseg / mmpretrain config (linattn_mm or stock) with mmengine's Runner.

Same flags as the stock OpenMMLab ``tools/train.py``:
    python tools/train.py CONFIG [--work-dir DIR] [--amp] [--auto-scale-lr] [--resume [CKPT]]
                                 [--cfg-options k=v ...] [--launcher none|pytorch|slurm|mpi]

``--compile-backbone [BACKEND]`` trains with the backbone under ``torch.compile``
(``linattn_mm.CompileBackboneHook``).

``--attn-core triton`` trains every Pola and NaLa mixer of the model with the Triton kernels of
its core, forward and backward (CUDA; the default is the torch training Function,
``core='fast'``; ``linattn_mm.cli.set_attention_core``). ``--attn-core fused`` trains them with
the fused cores (torch's products, the elementwise passes as Triton kernels; CUDA), and
NaLaFormer's blocks with their depth-wise conv sums as Triton kernels (``ffn_core='fused'``) and
every NaLa mixer with its gated output's LayerNorm and gate as Triton kernels
(``gate_core='fused'``), and NaLa's softmax mixers with the RoPE of q and k as a Triton kernel
(their ``core='fused'``).

``--demo`` runs CONFIG on the generated demo data with the demo schedule (``linattn_mm.demo``).
"""
import argparse

from mmengine.device import get_device

import linattn_mm  # noqa: F401  (registers the backbones)
from linattn_mm.checkpoint import safe_globals
from linattn_mm.models.attentions.nala import NaLaSoftmaxAttention
from linattn_mm.cli import (add_common_args, apply_launcher_defaults, build_runner,
                            close_process_group, find_resume_checkpoint, load_config,
                            parse_with_common, set_attention_core)
from linattn_mm.ops.dispatch import CORES


def parse_args(argv=None):
    p = argparse.ArgumentParser(description='Train a detector, segmentor or classifier')
    p.add_argument('config', help='config file path, or a model-zoo name '
                   '(linattn_mm.list_models())')
    p.add_argument('--amp', action='store_true', help='automatic mixed precision training')
    p.add_argument('--auto-scale-lr', action='store_true',
                   help='scale the learning rate by the actual batch size')
    p.add_argument('--resume', nargs='?', type=str, const='auto',
                   help='resume from CKPT, or from the latest checkpoint in the work dir if no '
                   'path is given')
    p.add_argument('--compile-backbone', nargs='?', const='inductor', default=None,
                   metavar='BACKEND', help='train with the backbone under torch.compile (backend '
                   'inductor, or the one named; linattn_mm.CompileBackboneHook)')
    p.add_argument('--attn-core', choices=CORES, default=None,
                   help="the core of every Pola and NaLa mixer of the model ('triton': the "
                   "Triton kernels, forward and backward, CUDA; 'fused': the torch cores' "
                   'products with their elementwise passes in Triton, CUDA)')
    return parse_with_common(add_common_args(p), argv)


def main(argv=None):
    args = parse_args(argv)
    if args.amp and get_device() == 'cpu':
        raise SystemExit('error: --amp trains with mmengine\'s AmpOptimWrapper, which needs a GPU '
                         '(or an NPU, MLU or MUSA device); on CPU, train in float32 (without '
                         '--amp)')
    cfg = load_config(args)
    if args.amp:
        wrapper = cfg.optim_wrapper.get('type', 'OptimWrapper')
        if wrapper == 'AmpOptimWrapper':
            print('AMP training is already enabled in the config')
        else:
            if wrapper != 'OptimWrapper':
                raise ValueError(f'--amp needs optim_wrapper.type OptimWrapper, got {wrapper}')
            cfg.optim_wrapper.type = 'AmpOptimWrapper'
            cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')
    if args.auto_scale_lr:
        if 'auto_scale_lr' not in cfg or 'base_batch_size' not in cfg.auto_scale_lr:
            raise RuntimeError('--auto-scale-lr needs auto_scale_lr.base_batch_size in the config')
        cfg.auto_scale_lr.enable = True
    if args.resume == 'auto':
        # the newest complete checkpoint of the work dir: a run killed while saving leaves a
        # truncated file (and possibly no last_checkpoint pointer) that must not be used
        cfg.resume = True
        cfg.load_from = find_resume_checkpoint(cfg.work_dir)
        if cfg.load_from is None:
            print(f'--resume: no complete checkpoint in {cfg.work_dir}; training from the start')
        else:
            print(f'--resume: resuming from {cfg.load_from}')
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume
    if args.compile_backbone:
        cfg.custom_hooks = list(cfg.get('custom_hooks', [])) + [
            dict(type='linattn_mm.CompileBackboneHook', backend=args.compile_backbone)]
    apply_launcher_defaults(cfg)
    runner = build_runner(cfg)
    if args.attn_core:
        mixers = set_attention_core(runner.model, args.attn_core)
        blocks = sum(getattr(m, 'ffn_core', None) == 'fused' for m in runner.model.modules())
        gates = sum(getattr(m, 'gate_core', None) == 'fused' for m in runner.model.modules())
        ropes = sum(isinstance(m, NaLaSoftmaxAttention) and m.core == 'fused'
                    for m in runner.model.modules())
        print(f'--attn-core: {mixers} Pola / NaLa mixers on core {args.attn_core!r}'
              + (f', {blocks} NaLaFormer blocks with fused conv sums' if blocks else '')
              + (f', {gates} NaLa mixers (softmax ones included) with fused gates'
                 if gates else '')
              + (f', {ropes} softmax mixers with a fused RoPE' if ropes else ''))
    try:
        with safe_globals():  # --resume / load_from: mmengine checkpoints hold HistoryBuffers
            runner.train()
    except BaseException:
        close_process_group(wait=False)
        raise
    close_process_group()


if __name__ == '__main__':
    main()
