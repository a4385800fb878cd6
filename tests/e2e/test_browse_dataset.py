"""tools/browse_dataset.py on the generated demo data: one PNG per sample at the pipeline's image
size, with the ground truth drawn (boxes and masks, the blended label map, the class name). The
configs are put on the demo data by ``--demo`` (the demo overlay)."""
import os.path as osp

import numpy as np
import pytest
from harness import CONFIGS, REPO, tool_main

N = 3
CASES = {
    'det': 'pvtv2/mask-rcnn_pvtv2-b0_fpn_1x_coco.py',
    'seg': 'pvtv2/fpn_pvtv2-b0_8xb4-40k_ade20k-512x512.py',
    'cls': 'pvtv2/pvtv2-b0_in1k.py',
}


def _browse(kind, out_dir, monkeypatch, phase='train'):
    monkeypatch.chdir(REPO)  # the demo overlay's data root is relative to the repository
    records = tool_main('browse_dataset')([osp.join(CONFIGS, CASES[kind]), '--demo', '--output-dir',
                                           str(out_dir), '--max-images', str(N), '--seed', '0',
                                           '--phase', phase])
    assert len(records) == N
    assert sorted(osp.basename(r['file']) for r in records) == sorted(
        p.name for p in out_dir.glob('*.png'))
    drawn = []
    from PIL import Image
    for r in records:
        assert osp.getsize(r['file']) > 0
        with Image.open(r['file']) as im:
            png = np.asarray(im.convert('RGB'))
        h, w = r['sample'].metainfo['img_shape'][:2]
        assert png.shape == (h, w, 3) == r['image'].shape, (r['file'], png.shape, (h, w))
        drawn.append(png)
    return records, drawn


def _changed(a, b):
    return np.abs(a.astype(np.int16) - b.astype(np.int16)).max(axis=-1) > 0


def test_browse_detection(demo_data, tmp_path, monkeypatch):
    records, drawn = _browse('det', tmp_path / 'det', monkeypatch)
    boxes_seen = 0
    for r, png in zip(records, drawn):
        gt = r['sample'].gt_instances
        boxes = np.asarray(gt.bboxes).reshape(-1, 4)
        for x1, y1, x2, y2 in boxes.round().astype(int):
            region = (slice(max(y1, 0), y2 + 1), slice(max(x1, 0), x2 + 1))
            if png[region].size == 0:
                continue
            boxes_seen += 1
            # box outline, mask fill or label text: something inside every box was drawn
            assert _changed(png[region], r['image'][region]).any(), (r['file'], (x1, y1, x2, y2))
        assert len(gt.masks) == len(boxes)
    assert boxes_seen > 0, 'the demo samples have no ground-truth boxes'


def test_browse_segmentation(demo_data, tmp_path, monkeypatch):
    records, drawn = _browse('seg', tmp_path / 'seg', monkeypatch)
    for r, png in zip(records, drawn):
        labels = np.asarray(r['sample'].gt_sem_seg.data)[0]
        valid = labels != 255
        assert valid.any(), r['file']
        # the label map is blended over every labelled pixel
        assert _changed(png, r['image'])[valid].mean() > 0.9, r['file']


def test_browse_classification(demo_data, tmp_path, monkeypatch):
    records, drawn = _browse('cls', tmp_path / 'cls', monkeypatch)
    for r, png in zip(records, drawn):
        assert _changed(png, r['image']).any(), r['file']  # the class name is written


@pytest.mark.parametrize('kind', ['det', 'seg'])
def test_browse_val_phase(demo_data, tmp_path, monkeypatch, kind):
    """The test pipelines load the ground truth after resizing the image (it stays at the original
    size): it is brought to the drawn image's size."""
    records, drawn = _browse(kind, tmp_path / kind, monkeypatch, phase='val')
    for r, png in zip(records, drawn):
        if kind == 'det':
            boxes = np.asarray(r['sample'].gt_instances.bboxes).reshape(-1, 4)
            h, w = png.shape[:2]
            assert (boxes[:, 2] <= w + 1).all() and (boxes[:, 3] <= h + 1).all(), boxes
            assert r['sample'].gt_instances.masks.shape[1:] == (h, w)
        else:
            assert tuple(r['sample'].gt_sem_seg.data.shape[-2:]) == png.shape[:2]
        assert _changed(png, r['image']).any(), r['file']
