"""Parameters and multiply-accumulates of a model at a fixed input shape, counting every attention
matmul (:mod:`linattn_mm.flops`; mmengine's module-hook counter misses functional matmuls and
scaled-dot-product attention).

    python tools/get_flops.py CONFIG [--shape H W] [--part model|backbone] [--depth 2] [--json F]

Default shapes: 800x1333 for mmdet configs (padded to 800x1344, the size divisor 32, as the data
preprocessor does), 512x512 for mmseg, 224x224 for mmpretrain. ``--part model`` counts the whole
detector / segmentor / classifier forward (``mode='tensor'``: the backbone, neck and heads as the
stock get_flops tools do; a two-stage detector includes its RoI heads on the RPN proposals),
``--part backbone`` the backbone only. "FLOPs" in the OpenMMLab / paper tables are these MACs.
"""
import argparse
import json

import linattn_mm  # noqa: F401
from linattn_mm.flops import config_macs


def parse_args(argv=None):
    from mmengine.config import DictAction
    p = argparse.ArgumentParser(description='Count parameters and MACs of a model')
    p.add_argument('config', help='config file (mmdet, mmseg or mmpretrain)')
    p.add_argument('--shape', type=int, nargs='+', help='input H W (or one side for a square)')
    p.add_argument('--part', choices=['model', 'backbone'], default='model')
    p.add_argument('--depth', type=int, default=2,
                   help='print per-module MACs down to this module depth (0: total only)')
    p.add_argument('--json', help='also write the numbers to this JSON file')
    p.add_argument('--cfg-options', nargs='+', action=DictAction, metavar='KEY=VALUE',
                   help='override config entries')
    args = p.parse_args(argv)
    if args.shape is not None and (len(args.shape) not in (1, 2) or min(args.shape) < 1):
        p.error(f'--shape takes H W or one side S (positive), got {" ".join(map(str, args.shape))}')
    return args


def get_flops(config, shape=None, part='model', cfg_options=None):
    """:func:`linattn_mm.flops.config_macs` of a config file with ``cfg_options`` merged; the
    result also names the config."""
    from mmengine.config import Config
    cfg = Config.fromfile(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    return dict(config=config, **config_macs(cfg, shape, part))


def module_rows(by_module, depth):
    """(module path, inclusive MACs) down to ``depth`` levels. A module whose ``forward`` was called
    directly (e.g. a detector's ``roi_head``) has no entry of its own; its MACs are the sum of its
    children's."""
    names = set()
    for k in by_module:
        parts = k.split('.') if k else []
        for i in range(1, min(len(parts), depth) + 1):
            names.add('.'.join(parts[:i]))

    def inclusive(name):
        if name in by_module:
            return by_module[name]
        kids = {name + '.' + k[len(name) + 1:].split('.')[0] for k in by_module
                if k.startswith(name + '.')}
        return sum(inclusive(c) for c in kids)

    return [(n, inclusive(n)) for n in sorted(names)]


def main(argv=None):
    args = parse_args(argv)
    res = get_flops(args.config, args.shape, args.part, args.cfg_options)
    print(f"{res['config']}  [{res['scope']}, {args.part}, input {res['input_shape']}]")
    print(f"params: {res['params'] / 1e6:.3f} M")
    print(f"MACs  : {res['macs'] / 1e9:.3f} G   (the 'FLOPs' of OpenMMLab and paper tables)")
    if args.depth:
        for k, v in module_rows(res['by_module'], args.depth):
            print(f'  {k:<40s} {v / 1e9:10.4f} G')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == '__main__':
    main()
