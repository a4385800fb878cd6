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
import math

import torch

import linattn_mm  # noqa: F401
from linattn_mm.flops import count_macs

DEFAULT_SHAPES = {'mmdet': (800, 1333), 'mmseg': (512, 512), 'mmpretrain': (224, 224)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description='Count parameters and MACs of a model')
    p.add_argument('config', help='config file (mmdet, mmseg or mmpretrain)')
    p.add_argument('--shape', type=int, nargs='+', help='input H W (or one side for a square)')
    p.add_argument('--part', choices=['model', 'backbone'], default='model')
    p.add_argument('--depth', type=int, default=2,
                   help='print per-module MACs down to this module depth (0: total only)')
    p.add_argument('--json', help='also write the numbers to this JSON file')
    p.add_argument('--cfg-options', nargs='+', default=[], metavar='KEY=VALUE',
                   help='override config entries')
    return p.parse_args(argv)


def _cfg_options(pairs):
    from mmengine.config import DictAction
    action = DictAction(option_strings=['--cfg-options'], dest='cfg_options')
    ns = argparse.Namespace()
    action(None, ns, pairs)
    return ns.cfg_options


def build_model(cfg):
    from mmengine.registry import MODELS, init_default_scope
    scope = cfg.get('default_scope', 'mmdet')
    init_default_scope(scope)
    model_cfg = cfg.model.copy()
    bb = model_cfg.get('backbone')
    if isinstance(bb, dict) and bb.get('init_cfg', {}) and \
            bb['init_cfg'].get('type') == 'Pretrained':
        bb['init_cfg'] = None  # counting needs no weights
    return MODELS.build(model_cfg).eval(), scope


def make_inputs(scope, shape, cfg):
    """Batch of one image at ``shape`` (padded to the size divisor for mmdet) and its data
    samples, as the data preprocessor would produce them."""
    H, W = shape
    if scope == 'mmdet':
        div = cfg.model.get('data_preprocessor', {}).get('pad_size_divisor', 32) or 1
        Hp, Wp = math.ceil(H / div) * div, math.ceil(W / div) * div
        from mmdet.structures import DetDataSample
        sample = DetDataSample(metainfo=dict(img_shape=(H, W), ori_shape=(H, W),
                                             pad_shape=(Hp, Wp), batch_input_shape=(Hp, Wp),
                                             scale_factor=(1.0, 1.0)))
        return torch.randn(1, 3, Hp, Wp), [sample]
    if scope == 'mmseg':
        from mmseg.structures import SegDataSample
        sample = SegDataSample(metainfo=dict(img_shape=(H, W), ori_shape=(H, W),
                                             pad_shape=(H, W), batch_input_shape=(H, W)))
        return torch.randn(1, 3, H, W), [sample]
    return torch.randn(1, 3, H, W), None


def get_flops(config, shape=None, part='model', cfg_options=None):
    """Returns a dict: config, scope, input shape, part, params, MACs and per-module MACs."""
    from mmengine.config import Config
    cfg = Config.fromfile(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    model, scope = build_model(cfg)
    if shape is None:
        shape = DEFAULT_SHAPES.get(scope, (224, 224))
    shape = tuple(shape) if len(shape) == 2 else (shape[0], shape[0])
    inputs, samples = make_inputs(scope, shape, cfg)
    if part == 'backbone':
        target, params = model.backbone, sum(p.numel() for p in model.backbone.parameters())
        count = count_macs(model.backbone, inputs)
    else:
        params = sum(p.numel() for p in model.parameters())
        count = count_macs(model, inputs, samples, mode='tensor')
        target = model
    del target
    return dict(config=config, scope=scope, input_shape=list(inputs.shape), part=part,
                params=params, macs=count.total, by_module=count.by_module)


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
    res = get_flops(args.config, args.shape, args.part,
                    _cfg_options(args.cfg_options) if args.cfg_options else None)
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
