"""Write a config that puts CONFIG on the demo data, for the tools that take no ``--demo`` flag
(``mim``, the stock OpenMMLab ``tools/train.py`` / ``tools/test.py``):

    python -m linattn_mm.demo CONFIG [-o FILE] [--data-root data/demo]
    mim train mmdet FILE

CONFIG is a config file or a model-zoo name (``linattn_mm.list_models()``). FILE inherits CONFIG
and holds the values of the demo overlay (``linattn_mm.demo.demo_patch``); by default it is
``<config name>_demo.py`` in the current directory.
"""
import argparse
import os.path as osp

from .overlay import DEMO_ROOT, write_demo_config


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog='python -m linattn_mm.demo',
                                description='Write a config that runs CONFIG on the demo data')
    p.add_argument('config', help='config file or model-zoo name')
    p.add_argument('-o', '--out', help='the config to write (default: ./<config name>_demo.py)')
    p.add_argument('--data-root', default=DEMO_ROOT,
                   help=f'where tools/make_demo_data.py wrote the data (default: {DEMO_ROOT}, '
                   'relative to the directory the training runs in)')
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    out = args.out or osp.splitext(osp.basename(args.config))[0] + '_demo.py'
    print(write_demo_config(args.config, out, args.data_root))


if __name__ == '__main__':
    main()
