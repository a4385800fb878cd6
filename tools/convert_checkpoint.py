"""Convert an official / mmpretrain / raw checkpoint offline into a tensors-only file.

The output is ``{'state_dict': {'backbone.<key>': tensor}, 'meta': {...}}``: it loads with
``torch.load(weights_only=True)`` anywhere, and with the stock ``init_cfg=dict(type='Pretrained',
checkpoint=OUT, prefix='backbone.')`` as well as linattn_mm's own loader.

    python tools/convert_checkpoint.py SRC DST [--model NAME_OR_CONFIG] [--prefix backbone.]
                                       [--no-ema] [--allow-unsafe-pickle]

With ``--model`` the weights are also checked against (and resized to) that zoo model's backbone,
e.g. ``--model mask-rcnn_swin-t_fpn_1x_coco``; the load report is printed.
"""
import argparse
import os.path as osp
import sys

import linattn_mm
from linattn_mm.checkpoint import CheckpointError, convert_checkpoint
from linattn_mm.utils.progress import emit, progress_bar


def parse_args(argv=None):
    p = argparse.ArgumentParser(description='Convert a checkpoint to a tensors-only file')
    p.add_argument('src', help='input checkpoint (path or http(s) URL)')
    p.add_argument('dst', help='output file')
    p.add_argument('--model', help='zoo model name or config whose backbone the weights are '
                   'checked against and resized to')
    p.add_argument('--prefix', default='backbone.', help="key prefix of the output (default "
                   "'backbone.')")
    p.add_argument('--no-ema', action='store_true', help='use model weights even when the file '
                   'has EMA weights')
    p.add_argument('--allow-unsafe-pickle', action='store_true',
                   help='full pickle loading (runs code from the file: only for trusted files)')
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if '://' not in args.src and not osp.isfile(args.src):
        print(f'error: no checkpoint file {args.src!r}', file=sys.stderr)
        return 1
    # steps: build the target model (with --model), then load, convert and write the file
    bar = progress_bar(2 if args.model else 1, 'convert', unit='step',
                       bar_format='{desc}: {n}/{total} steps |{bar}|{postfix} [{elapsed}]')
    target = None
    if args.model:
        if bar is not None:
            bar.set_postfix_str(f'building {args.model}')
        model = linattn_mm.get_model(args.model, backbone=dict(init_cfg=None), convert=False)
        target = getattr(model, 'backbone', model)
        if bar is not None:
            bar.update()
    emit(bar, f'converting {args.src}')
    if bar is not None:
        bar.set_postfix_str(f'loading and converting {args.src}')
    try:
        report = convert_checkpoint(args.src, args.dst, prefix=args.prefix,
                                    allow_unsafe_pickle=True if args.allow_unsafe_pickle else None,
                                    prefer_ema=not args.no_ema, model=target)
    except (CheckpointError, OSError) as e:
        if bar is not None:
            bar.close()
        print(f'error: {e}', file=sys.stderr)
        return 1
    if bar is not None:
        bar.update()
        bar.close()
    print(report.summary())
    print(f'wrote {args.dst}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
