"""Train any mmdet / mmseg / mmpretrain config (linattn_mm or stock) with mmengine's Runner.

Same flags as the stock OpenMMLab ``tools/train.py``:
    python tools/train.py CONFIG [--work-dir DIR] [--amp] [--auto-scale-lr] [--resume [CKPT]]
                                 [--cfg-options k=v ...] [--launcher none|pytorch|slurm|mpi]
"""
import argparse
import os
import os.path as osp

from mmengine.config import Config, DictAction

import linattn_mm  # noqa: F401  (registers the backbones, allow-lists safe checkpoint objects)
from linattn_mm.runner import apply_launcher_defaults, build_runner


def parse_args(argv=None):
    p = argparse.ArgumentParser(description='Train a detector, segmentor or classifier')
    p.add_argument('config', help='config file path')
    p.add_argument('--work-dir', help='directory for logs and checkpoints')
    p.add_argument('--amp', action='store_true', help='automatic mixed precision training')
    p.add_argument('--auto-scale-lr', action='store_true',
                   help='scale the learning rate by the actual batch size')
    p.add_argument('--resume', nargs='?', type=str, const='auto',
                   help='resume from CKPT, or from the latest checkpoint in the work dir if no '
                   'path is given')
    p.add_argument('--cfg-options', nargs='+', action=DictAction,
                   help='override config settings, e.g. train_cfg.max_epochs=1')
    p.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'], default='none')
    p.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = p.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def main(argv=None):
    args = parse_args(argv)
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
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
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume
    apply_launcher_defaults(cfg)
    runner = build_runner(cfg)
    runner.train()


if __name__ == '__main__':
    main()
