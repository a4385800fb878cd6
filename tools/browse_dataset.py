"""Draw the ground truth of a config's dataset samples, after its pipeline, into PNG files.

    python tools/browse_dataset.py CONFIG --output-dir DIR [--max-images 20] [--phase train]
                                   [--demo] [--cfg-options k=v ...]

One PNG per sample, at the size of the pipeline's output image (what the model sees). Detection:
boxes, masks and class names (mmdet's ``DetLocalVisualizer``); segmentation: the label map blended
over the image (mmseg's ``SegLocalVisualizer``); classification: the class name as text
(mmpretrain's ``UniversalVisualizer``). The library is chosen by the config's ``default_scope``.
Random transforms (flips, crops) are drawn as sampled; ``--seed`` makes a run repeatable.
"""
import argparse
import importlib
import os
import os.path as osp
import sys

import numpy as np

import linattn_mm  # noqa: F401  (registers the backbones in every downstream registry)

VISUALIZERS = {
    'mmdet': ('mmdet.visualization', 'DetLocalVisualizer'),
    'mmseg': ('mmseg.visualization', 'SegLocalVisualizer'),
    'mmpretrain': ('mmpretrain.visualization', 'UniversalVisualizer'),
}


def parse_args(argv=None):
    from mmengine.config import DictAction
    p = argparse.ArgumentParser(description='Draw the ground truth of dataset samples')
    p.add_argument('config', help='config file path')
    p.add_argument('--output-dir', required=True, help='folder for the PNG files')
    p.add_argument('--max-images', type=int, default=20, help='number of samples to draw')
    p.add_argument('--phase', choices=['train', 'val', 'test'], default='train',
                   help='which dataloader of the config to browse (default: train)')
    p.add_argument('--seed', type=int, default=None, help='seed for the random transforms')
    p.add_argument('--demo', action='store_true',
                   help='the config on the generated demo data (linattn_mm.demo.apply_demo)')
    p.add_argument('--cfg-options', nargs='+', action=DictAction,
                   help='override config settings, e.g. train_dataloader.dataset.indices=4')
    return p.parse_args(argv)


def build_dataset(cfg, phase='train'):
    """The dataset of ``cfg.<phase>_dataloader`` built in the config's library (its
    ``default_scope``, made the current scope)."""
    from mmengine.registry import init_default_scope
    scope = cfg.get('default_scope')
    if scope not in VISUALIZERS:
        raise ValueError(f'default_scope must be one of {sorted(VISUALIZERS)}, got {scope!r}')
    init_default_scope(scope)
    registry = importlib.import_module(f'{scope}.registry')
    return registry.DATASETS.build(cfg[f'{phase}_dataloader']['dataset']), scope


def make_visualizer(scope, metainfo):
    module, name = VISUALIZERS[scope]
    cls = getattr(importlib.import_module(module), name)
    vis = cls(name=f'browse_dataset_{scope}_{id(metainfo)}')
    vis.dataset_meta = dict(metainfo)
    return vis


def to_rgb(inputs):
    """The packed (C, H, W) BGR image tensor of a sample as an (H, W, 3) RGB uint8 array."""
    img = inputs.detach().cpu().numpy().transpose(1, 2, 0)
    if img.shape[2] == 1:
        img = np.repeat(img, 3, axis=2)
    return np.ascontiguousarray(img[..., ::-1]).clip(0, 255).astype(np.uint8)


def annotations_after_resize(pipeline):
    """True when the pipeline resizes the image before it loads the annotations (the usual test
    pipelines: the ground truth stays at the original size, for evaluation)."""
    types = [str(t.get('type', '')) if isinstance(t, dict) else type(t).__name__ for t in pipeline]
    load = [i for i, t in enumerate(types) if t.startswith('LoadAnnotations')]
    resize = [i for i, t in enumerate(types) if 'Resize' in t]
    return bool(load and resize and min(resize) < min(load))


def draw(vis, scope, name, image, sample, out_file, gt_at_original_size=False):
    h, w = image.shape[:2]
    if scope == 'mmdet' and 'gt_instances' in sample:
        # the visualizer takes plain arrays: box objects as an (n, 4) tensor, masks as booleans,
        # both in the coordinates of the drawn image
        gt = sample.gt_instances
        boxes, masks = gt.get('bboxes', None), gt.get('masks', None)
        if gt_at_original_size and boxes is not None and 'scale_factor' in sample.metainfo:
            boxes.rescale_(sample.metainfo['scale_factor'])
        if boxes is not None and hasattr(boxes, 'tensor'):
            gt.bboxes = boxes.tensor
        if masks is not None and hasattr(masks, 'to_ndarray'):
            if (masks.height, masks.width) != (h, w):
                masks = masks.resize((h, w))
            gt.masks = masks.to_ndarray().astype(bool)
    if scope == 'mmseg' and 'gt_sem_seg' in sample:
        seg = sample.gt_sem_seg.data
        if tuple(seg.shape[-2:]) != (h, w):  # nearest-neighbour, for drawing only
            import torch.nn.functional as F
            from mmengine.structures import PixelData
            seg = F.interpolate(seg[None].float(), size=(h, w), mode='nearest')[0]
            sample.gt_sem_seg = PixelData(data=seg.to(sample.gt_sem_seg.data.dtype))
    if scope == 'mmpretrain':
        vis.visualize_cls(image, sample, draw_pred=False, draw_score=False, out_file=out_file,
                          name=name)
    else:
        vis.add_datasample(name, image, sample, draw_gt=True, draw_pred=False, show=False,
                           out_file=out_file)


def browse(cfg, output_dir, max_images=20, phase='train', seed=None, progress=True):
    """Write one PNG per sample; return a list of dicts ``{'file', 'image', 'sample'}`` (the
    pipeline's RGB image before drawing and its data sample) for the drawn samples."""
    from mmengine.utils import ProgressBar
    if seed is not None:
        from mmengine.runner import set_random_seed
        set_random_seed(seed)
    dataset, scope = build_dataset(cfg, phase)
    pipeline = cfg[f'{phase}_dataloader']['dataset'].get('pipeline') or []
    original_size = annotations_after_resize(pipeline)
    vis = make_visualizer(scope, dataset.metainfo)
    os.makedirs(output_dir, exist_ok=True)
    num = min(len(dataset), max_images)
    bar = ProgressBar(num, file=sys.stderr) if progress and num else None
    records = []
    for i in range(num):
        item = dataset[i]
        image, sample = to_rgb(item['inputs']), item['data_samples']
        src = sample.metainfo.get('img_path') or f'sample{i}'
        out_file = osp.join(output_dir, f'{i:05d}_{osp.splitext(osp.basename(src))[0]}.png')
        draw(vis, scope, osp.basename(out_file), image, sample, out_file, original_size)
        records.append(dict(file=out_file, image=image, sample=sample))
        if bar is not None:
            bar.update()
    if bar is not None:
        sys.stderr.write('\n')
    return records


def main(argv=None):
    from mmengine.config import Config
    args = parse_args(argv)
    cfg = Config.fromfile(args.config)
    if args.demo:
        from linattn_mm.demo import apply_demo
        apply_demo(cfg)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    records = browse(cfg, args.output_dir, args.max_images, args.phase, args.seed,
                     progress=True)
    print(f'wrote {len(records)} images to {args.output_dir}')
    return records


if __name__ == '__main__':
    main()
