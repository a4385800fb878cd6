"""Synthetic batches for timing and memory measurements of whole models: a random image batch at a
given size and annotations shaped like the demo data (a few boxes with labels and masks per image
for detectors, a label map for segmentors, a class label for classifiers), deterministic given a
seed. The images are already normalised (what the data preprocessor would output)."""
import math

import numpy as np
import torch

__all__ = ['training_batch']


def _boxes(g, n, H, W):
    """``n`` boxes (x1, y1, x2, y2) inside an H x W image, sides between 1/10 and 1/2 of it."""
    wh = torch.rand(n, 2, generator=g) * 0.4 + 0.1
    wh = wh * torch.tensor([W, H])
    xy = torch.rand(n, 2, generator=g) * (torch.tensor([W, H]) - wh)
    return torch.cat([xy, xy + wh], dim=1)


def _det_sample(g, cfg, H, W, Hp, Wp, num_objects):
    from mmdet.structures import DetDataSample
    from mmdet.structures.mask import BitmapMasks
    from mmengine.structures import InstanceData
    head = cfg.model.get('roi_head', cfg.model.get('bbox_head', {}))
    bbox_head = head.get('bbox_head', head) if isinstance(head, dict) else {}
    if isinstance(bbox_head, (list, tuple)):  # cascade: one head per stage
        bbox_head = bbox_head[0]
    classes = int(bbox_head.get('num_classes', 80))
    boxes = _boxes(g, num_objects, H, W)
    masks = np.zeros((num_objects, H, W), dtype=np.uint8)
    for i, (x1, y1, x2, y2) in enumerate(boxes.round().long().tolist()):
        masks[i, y1:max(y2, y1 + 1), x1:max(x2, x1 + 1)] = 1
    sample = DetDataSample(metainfo=dict(img_shape=(H, W), ori_shape=(H, W), pad_shape=(Hp, Wp),
                                         batch_input_shape=(Hp, Wp), scale_factor=(1.0, 1.0)))
    sample.gt_instances = InstanceData(
        bboxes=boxes, labels=torch.randint(classes, (num_objects, ), generator=g),
        masks=BitmapMasks(masks, H, W))
    return sample


def _seg_sample(g, cfg, H, W):
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample
    classes = int(cfg.model.decode_head.get('num_classes', 150))
    sample = SegDataSample(metainfo=dict(img_shape=(H, W), ori_shape=(H, W), pad_shape=(H, W),
                                         batch_input_shape=(H, W)))
    sample.gt_sem_seg = PixelData(data=torch.randint(classes, (1, H, W), generator=g))
    return sample


def _cls_sample(g, cfg):
    from mmpretrain.structures import DataSample
    classes = int(cfg.model.head.get('num_classes', 1000))
    return DataSample().set_gt_label(int(torch.randint(classes, (1, ), generator=g)))


def training_batch(cfg, shape, batch=1, seed=0, num_objects=5):
    """``(inputs, data_samples)`` for ``model(inputs, data_samples, mode='loss')`` of the model of
    ``cfg`` (mmdet, mmseg or mmpretrain): ``batch`` random images of ``shape`` (H, W) (mmdet:
    padded to the size divisor) and annotations shaped like the demo data."""
    H, W = shape
    g = torch.Generator().manual_seed(seed)
    scope = cfg.get('default_scope', 'mmpretrain')
    Hp, Wp = H, W
    if scope == 'mmdet':
        div = cfg.model.get('data_preprocessor', {}).get('pad_size_divisor', 32) or 1
        Hp, Wp = math.ceil(H / div) * div, math.ceil(W / div) * div
        samples = [_det_sample(g, cfg, H, W, Hp, Wp, num_objects) for _ in range(batch)]
    elif scope == 'mmseg':
        samples = [_seg_sample(g, cfg, H, W) for _ in range(batch)]
    else:
        samples = [_cls_sample(g, cfg) for _ in range(batch)]
    return torch.randn(batch, 3, Hp, Wp, generator=g), samples
