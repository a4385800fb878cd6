"""Generate the small synthetic demo datasets (COCO instances, ADE20K, ImageNet layouts).

Usage:
    python tools/make_demo_data.py [--root data/demo] [--tasks coco ade imagenet] [--seed 0]
                                   [--num-train 48] [--num-val 16] [--overwrite]

Same arguments give byte-identical files; an up-to-date task folder (matching
``.demo_stamp.json``) is skipped unless ``--overwrite`` is given.
"""
import argparse

from linattn_mm.demo import TASKS, make_demo_data


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--root', default='data/demo', help='output root (default: data/demo)')
    parser.add_argument(
        '--tasks', nargs='+', default=list(TASKS), choices=TASKS, help='datasets to generate')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--num-train', type=int, default=48, help='training images per task')
    parser.add_argument('--num-val', type=int, default=16, help='validation images per task')
    parser.add_argument(
        '--overwrite', action='store_true', help='regenerate even if the stamp is up to date')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    result = make_demo_data(
        root=args.root,
        tasks=args.tasks,
        seed=args.seed,
        num_train=args.num_train,
        num_val=args.num_val,
        overwrite=args.overwrite,
        progress=True)
    for task, info in result['tasks'].items():
        state = 'skipped (up to date)' if info['skipped'] else 'written'
        print(f'{task}: {state}; data_root = {info["data_root"]}')
        for split, counts in info['summary'].items():
            parts = [f'{k}={v}' for k, v in counts.items() if not isinstance(v, dict)]
            detail = {k: v for k, v in counts.items() if isinstance(v, dict)}
            extra = ''.join(f' {k}={v}' for k, v in detail.items())
            print(f'  {split}: {", ".join(parts)}{extra}')
        print(f'  {len(info["files"])} files, sha256 {info["digest"][:16]}')


if __name__ == '__main__':
    main()
