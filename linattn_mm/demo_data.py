"""Deterministic, small, synthetic demo datasets in three standard on-disk formats.

The generated folders can be used unchanged by the stock OpenMMLab dataset classes; only
``data_root`` has to be pointed at them:

* ``<root>/coco/``  -- COCO 2017 instance format (``mmdet.datasets.CocoDataset``)::

      annotations/instances_train2017.json   annotations/instances_val2017.json
      train2017/000000000001.jpg ...         val2017/000000000001.jpg ...

  Every image holds 1-4 non-overlapping filled shapes on a textured, low-saturation background.
  Three shapes are mapped onto real COCO categories (the JSON lists all 80 COCO 2017 categories
  with their real ids, so the stock 80-class settings apply unchanged)::

      circle   -> 'sports ball' (id 37), red family
      triangle -> 'kite'        (id 38), green family
      square   -> 'tv'          (id 72), blue family

* ``<root>/ade/ADEChallengeData2016/`` -- ADE20K format (``mmseg.datasets.ADE20KDataset``)::

      images/training/ADE_train_00000001.jpg       annotations/training/ADE_train_00000001.png
      images/validation/ADE_val_00000001.jpg       annotations/validation/ADE_val_00000001.png

  Label PNGs are single-channel uint8 with the ADE20K PNG values (0 = other/unlabelled, ignored
  with ``reduce_zero_label=True``; value ``v`` is ADE20K class ``v - 1`` after the reduction):
  wall=1, sky=3, floor=4, tree=5, car=21.

* ``<root>/imagenet/`` -- ImageNet layout (``mmpretrain.datasets.ImageNet``)::

      train/<wnid>/<wnid>_00000.JPEG    val/<wnid>/<wnid>_val_00000.JPEG
      meta/train.txt    meta/val.txt     (lines: '<path relative to the split folder> <label>')

  Four real ImageNet-1k classes with their true indices: n01440764 (0, tench), n01443537
  (1, goldfish), n01484850 (2, great white shark), n01491361 (3, tiger shark); each class is a
  distinct 64x64 pattern + colour family.

Generation is deterministic (same arguments -> byte-identical files) and idempotent: each task
folder gets a ``.demo_stamp.json`` recording the generator version and arguments; a later call
with the same arguments skips the task. Only numpy and Pillow are required.
"""
import hashlib
import json
import os
import time

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    'make_demo_data', 'GENERATOR_VERSION', 'TASKS', 'STAMP_NAME', 'COCO_CATEGORIES', 'COCO_SHAPES',
    'COCO_SHAPE_COLOURS', 'ADE_LABELS', 'ADE_COLOURS', 'IMAGENET_CLASSES'
]

GENERATOR_VERSION = 1
TASKS = ('coco', 'ade', 'imagenet')
STAMP_NAME = '.demo_stamp.json'

# COCO 2017: list index == category id; None marks the 10 ids that are unused in the 2017 release.
_COCO_BY_ID = [
    None, 'person', 'bicycle', 'car', 'motorcycle', 'airplane', 'bus', 'train', 'truck', 'boat',
    'traffic light', 'fire hydrant', None, 'stop sign', 'parking meter', 'bench', 'bird', 'cat',
    'dog', 'horse', 'sheep', 'cow', 'elephant', 'bear', 'zebra', 'giraffe', None, 'backpack',
    'umbrella', None, None, 'handbag', 'tie', 'suitcase', 'frisbee', 'skis', 'snowboard',
    'sports ball', 'kite', 'baseball bat', 'baseball glove', 'skateboard', 'surfboard',
    'tennis racket', 'bottle', None, 'wine glass', 'cup', 'fork', 'knife', 'spoon', 'bowl',
    'banana', 'apple', 'sandwich', 'orange', 'broccoli', 'carrot', 'hot dog', 'pizza', 'donut',
    'cake', 'chair', 'couch', 'potted plant', 'bed', None, 'dining table', None, None, 'toilet',
    None, 'tv', 'laptop', 'mouse', 'remote', 'keyboard', 'cell phone', 'microwave', 'oven',
    'toaster', 'sink', 'refrigerator', None, 'book', 'clock', 'vase', 'scissors', 'teddy bear',
    'hair drier', 'toothbrush'
]
_COCO_SUPERCATEGORY = {
    'person': ('person', ),
    'vehicle': ('bicycle', 'car', 'motorcycle', 'airplane', 'bus', 'train', 'truck', 'boat'),
    'outdoor': ('traffic light', 'fire hydrant', 'stop sign', 'parking meter', 'bench'),
    'animal': ('bird', 'cat', 'dog', 'horse', 'sheep', 'cow', 'elephant', 'bear', 'zebra',
               'giraffe'),
    'accessory': ('backpack', 'umbrella', 'handbag', 'tie', 'suitcase'),
    'sports': ('frisbee', 'skis', 'snowboard', 'sports ball', 'kite', 'baseball bat',
               'baseball glove', 'skateboard', 'surfboard', 'tennis racket'),
    'kitchen': ('bottle', 'wine glass', 'cup', 'fork', 'knife', 'spoon', 'bowl'),
    'food': ('banana', 'apple', 'sandwich', 'orange', 'broccoli', 'carrot', 'hot dog', 'pizza',
             'donut', 'cake'),
    'furniture': ('chair', 'couch', 'potted plant', 'bed', 'dining table', 'toilet'),
    'electronic': ('tv', 'laptop', 'mouse', 'remote', 'keyboard', 'cell phone'),
    'appliance': ('microwave', 'oven', 'toaster', 'sink', 'refrigerator'),
    'indoor': ('book', 'clock', 'vase', 'scissors', 'teddy bear', 'hair drier', 'toothbrush'),
}
_SUPER_OF = {name: sup for sup, names in _COCO_SUPERCATEGORY.items() for name in names}
#: All 80 COCO 2017 categories as written into the JSON (``id``, ``name``, ``supercategory``).
COCO_CATEGORIES = [
    dict(id=cid, name=name, supercategory=_SUPER_OF[name]) for cid, name in enumerate(_COCO_BY_ID)
    if name is not None
]
assert len(COCO_CATEGORIES) == 80 and len(_SUPER_OF) == 80
_COCO_ID = {c['name']: c['id'] for c in COCO_CATEGORIES}

#: shape kind -> COCO category name used for it.
COCO_SHAPES = {'circle': 'sports ball', 'square': 'tv', 'triangle': 'kite'}
#: COCO category name -> base RGB colour of its shapes (each object is jittered around it).
COCO_SHAPE_COLOURS = {'sports ball': (215, 45, 40), 'tv': (40, 75, 215), 'kite': (45, 180, 55)}
_SHAPE_KINDS = ('circle', 'square', 'triangle')
_CIRCLE_POINTS = 32

#: ADE20K PNG value (1-based class index, 0 = other) -> class name.
ADE_LABELS = {0: 'other', 1: 'wall', 3: 'sky', 4: 'floor', 5: 'tree', 21: 'car'}
#: ADE20K PNG value -> base RGB colour in the demo images.
ADE_COLOURS = {
    0: (25, 25, 28),
    1: (200, 188, 165),
    3: (110, 170, 235),
    4: (120, 85, 55),
    5: (40, 120, 40),
    21: (190, 30, 35),
}
_WALL, _SKY, _FLOOR, _TREE, _CAR = 1, 3, 4, 5, 21

#: (wnid, ImageNet-1k index, name) of the four demo classes.
IMAGENET_CLASSES = (
    ('n01440764', 0, 'tench'),
    ('n01443537', 1, 'goldfish'),
    ('n01484850', 2, 'great white shark'),
    ('n01491361', 3, 'tiger shark'),
)
# pattern foreground colour per class (background is a dark version of a random colour)
_IMAGENET_COLOURS = ((225, 130, 40), (230, 205, 45), (60, 110, 210), (150, 60, 190))

_TASK_CODE = {'coco': 1, 'ade': 2, 'imagenet': 3}
_SPLIT_CODE = {'train': 1, 'val': 2}
_JPEG_KW = dict(format='JPEG', quality=92, subsampling=0, optimize=False, progressive=False)
_PNG_KW = dict(format='PNG', compress_level=6, optimize=False)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _rng(seed, task, split, index):
    """Independent generator per (seed, task, split, image index)."""
    return np.random.default_rng([int(seed), _TASK_CODE[task], _SPLIT_CODE[split], int(index)])


def _to_uint8(arr):
    return np.clip(np.rint(arr), 0, 255).astype(np.uint8)


def _save_jpeg(arr, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(_to_uint8(arr)).save(path, **_JPEG_KW)


def _save_png_labels(lab, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(np.ascontiguousarray(lab, dtype=np.uint8)).save(path, **_PNG_KW)


def _write_json(obj, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8', newline='\n') as f:
        json.dump(obj, f, sort_keys=True, separators=(',', ':'))
        f.write('\n')


def _write_text(lines, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8', newline='\n') as f:
        f.write(''.join(line + '\n' for line in lines))


def _smooth_field(rng, h, w, grid, channels=3):
    """Low-frequency random field in [0, 1] of shape (h, w, channels)."""
    small = rng.random((grid, grid, channels))
    chans = [
        np.asarray(
            Image.fromarray((small[..., c] * 255).astype(np.uint8)).resize((w, h), Image.BICUBIC),
            dtype=np.float32) / 255.0 for c in range(channels)
    ]
    return np.stack(chans, axis=-1)


# Masks follow the COCO / pycocotools convention: pixel (x, y) covers [x, x+1) x [y, y+1) and
# belongs to the mask when its centre (x + .5, y + .5) lies inside the polygon. They are drawn with
# PIL on a canvas supersampled by _SUPERSAMPLE, keeping the pixel-centre samples (PIL at scale 1
# would fill every pixel the closed polygon touches, i.e. a ~1 px larger mask). Polygon vertices are
# stored at odd multiples of 1/_SUPERSAMPLE px: exact integers on the supersampled canvas, and never
# on a pixel-centre row/column, so axis-aligned edges cannot tie with a sample point.
_SUPERSAMPLE = 16


def _quantise(v):
    """Round to the nearest odd multiple of 1/_SUPERSAMPLE (exactly representable floats)."""
    return (np.floor(np.asarray(v) * (_SUPERSAMPLE / 2)) * 2 + 1) / _SUPERSAMPLE


def _rasterise(polygon, w, h):
    """Binary mask (h, w) of a flat [x1, y1, x2, y2, ...] polygon (pixel-centre sampling)."""
    s = _SUPERSAMPLE
    xs, ys = np.asarray(polygon[0::2], np.float64), np.asarray(polygon[1::2], np.float64)
    x0, y0 = max(int(np.floor(xs.min())) - 1, 0), max(int(np.floor(ys.min())) - 1, 0)
    x1, y1 = min(int(np.ceil(xs.max())) + 1, w), min(int(np.ceil(ys.max())) + 1, h)
    mask = np.zeros((h, w), bool)
    if x1 <= x0 or y1 <= y0:
        return mask
    canvas = Image.new('L', ((x1 - x0) * s, (y1 - y0) * s), 0)
    pts = [(int(round((x - x0) * s)), int(round((y - y0) * s))) for x, y in zip(xs, ys)]
    ImageDraw.Draw(canvas).polygon(pts, fill=1)
    mask[y0:y1, x0:x1] = np.asarray(canvas, dtype=bool)[s // 2::s, s // 2::s]
    return mask


# --------------------------------------------------------------------------------------------
# COCO
# --------------------------------------------------------------------------------------------
def _shape_polygon(kind, size, rng):
    """Polygon (N, 2) centred on the origin; ``size`` is the nominal diameter / side length."""
    if kind == 'circle':
        r = size / 2.0
        phase = rng.uniform(0, 2 * np.pi)
        t = phase + 2 * np.pi * np.arange(_CIRCLE_POINTS) / _CIRCLE_POINTS
        return np.stack([r * np.cos(t), r * np.sin(t)], axis=1)
    if kind == 'square':
        half = size / 2.0
        theta = np.deg2rad(rng.uniform(-30, 30)) if rng.random() < 0.6 else 0.0
        corners = np.array([[-half, -half], [half, -half], [half, half], [-half, half]])
        rot = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
        return corners @ rot.T
    if kind == 'triangle':
        circ_r = size / np.sqrt(3.0)  # equilateral triangle with side ``size``
        theta = rng.uniform(0, 2 * np.pi)
        t = theta + 2 * np.pi * np.arange(3) / 3
        return np.stack([circ_r * np.cos(t), circ_r * np.sin(t)], axis=1)
    raise ValueError(kind)


def _coco_image(rng):
    """One image: (uint8 array, list of (category name, flat polygon, mask))."""
    w = int(rng.integers(128, 225))
    h = int(rng.integers(128, 225))
    # textured, low-saturation background
    grey = rng.uniform(80, 170)
    tint = rng.uniform(-12, 12, size=3)
    field = _smooth_field(rng, h, w, grid=int(rng.integers(3, 7)))
    img = grey + tint + (field - 0.5) * 70.0
    img = img.mean(axis=2, keepdims=True) * 0.7 + img * 0.3  # keep the background greyish
    img = img + rng.normal(0, 9, size=(h, w, 1)) + rng.normal(0, 3, size=(h, w, 3))
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)

    objects, boxes = [], []
    n_target = int(rng.integers(1, 5))
    for _ in range(n_target):
        kind = _SHAPE_KINDS[int(rng.integers(0, 3))]
        for _attempt in range(40):
            size = float(rng.uniform(24, min(90.0, min(w, h) * 0.6)))
            poly = _shape_polygon(kind, size, rng)
            poly *= size / (poly.max(axis=0) - poly.min(axis=0)).max()  # longest bbox side = size
            lo, hi = poly.min(axis=0), poly.max(axis=0)
            cx = rng.uniform(2 - lo[0], w - 3 - hi[0])
            cy = rng.uniform(2 - lo[1], h - 3 - hi[1])
            pts = _quantise(poly + [cx, cy])
            box = (pts[:, 0].min(), pts[:, 1].min(), pts[:, 0].max(), pts[:, 1].max())
            margin = 3.0
            if all(box[0] > b[2] + margin or box[2] < b[0] - margin or box[1] > b[3] + margin
                   or box[3] < b[1] - margin for b in boxes):
                break
        else:
            continue  # could not place this shape without overlap
        boxes.append(box)
        flat = [float(v) for v in pts.reshape(-1)]
        mask = _rasterise(flat, w, h)
        name = COCO_SHAPES[kind]
        colour = np.asarray(COCO_SHAPE_COLOURS[name], np.float32) + rng.uniform(-18, 18, size=3)
        # soft shading across the object + per-pixel noise
        gx, gy = rng.uniform(-1, 1, size=2)
        shade = ((xx - cx) * gx + (yy - cy) * gy) / max(size, 1.0) * 12.0
        obj = colour + shade[..., None] + rng.normal(0, 6, size=(h, w, 3))
        img[mask] = obj[mask]
        objects.append((name, flat, mask))
    return _to_uint8(img), objects


def _coco_split(task_dir, split, seed, num):
    folder = f'{split}2017'
    images, annotations = [], []
    per_cat = {name: 0 for name in sorted(COCO_SHAPES.values())}
    ann_id = 0
    for i in range(num):
        image_id = i + 1
        file_name = f'{image_id:012d}.jpg'
        arr, objects = _coco_image(_rng(seed, 'coco', split, i))
        h, w = arr.shape[:2]
        _save_jpeg(arr, os.path.join(task_dir, folder, file_name))
        images.append(dict(id=image_id, file_name=file_name, width=w, height=h))
        for name, flat, mask in objects:
            ann_id += 1
            xs, ys = flat[0::2], flat[1::2]
            x0, y0 = min(xs), min(ys)
            annotations.append(
                dict(
                    id=ann_id,
                    image_id=image_id,
                    category_id=_COCO_ID[name],
                    segmentation=[flat],
                    bbox=[x0, y0, max(xs) - x0, max(ys) - y0],  # exact: vertices are k/16
                    area=float(mask.sum()),
                    iscrowd=0))
            per_cat[name] += 1
    coco = dict(
        info=dict(
            description='linattn_mm synthetic demo data (COCO 2017 instance format)',
            version=str(GENERATOR_VERSION),
            year=2017,
            contributor='linattn_mm.demo_data',
            url='',
            date_created=''),
        licenses=[],
        images=images,
        annotations=annotations,
        categories=COCO_CATEGORIES)
    _write_json(coco, os.path.join(task_dir, 'annotations', f'instances_{split}2017.json'))
    return dict(images=len(images), annotations=len(annotations), per_category=per_cat)


def _coco_files(num_train, num_val):
    files = ['annotations/instances_train2017.json', 'annotations/instances_val2017.json']
    files += [f'train2017/{i + 1:012d}.jpg' for i in range(num_train)]
    files += [f'val2017/{i + 1:012d}.jpg' for i in range(num_val)]
    return files


def _gen_coco(task_dir, seed, num_train, num_val):
    return dict(
        train=_coco_split(task_dir, 'train', seed, num_train),
        val=_coco_split(task_dir, 'val', seed, num_val))


# --------------------------------------------------------------------------------------------
# ADE20K
# --------------------------------------------------------------------------------------------
_ADE_SPLITS = {'train': ('training', 'ADE_train'), 'val': ('validation', 'ADE_val')}


def _ade_image(rng):
    w = int(rng.integers(128, 193))
    h = int(rng.integers(128, 193))
    lab_img = Image.new('L', (w, h), _WALL)
    d = ImageDraw.Draw(lab_img)
    y_sky = h * rng.uniform(0.22, 0.38)
    y_floor = h * rng.uniform(0.62, 0.78)
    s1, s2 = rng.uniform(-0.06, 0.06, size=2) * h
    d.polygon([(0, 0), (w, 0), (w, y_sky + s1), (0, y_sky - s1)], fill=_SKY)
    d.polygon([(0, y_floor - s2), (w, y_floor + s2), (w, h), (0, h)], fill=_FLOOR)
    for _ in range(int(rng.integers(1, 3))):  # trees: trunk + canopy
        tx = rng.uniform(0.08, 0.92) * w
        tw = rng.uniform(3, 7)
        rx, ry = rng.uniform(12, 26), rng.uniform(14, 30)
        cy = rng.uniform(y_sky - 0.3 * ry, (y_sky + y_floor) / 2)
        base = y_floor + rng.uniform(-2, 6)
        d.rectangle([tx - tw / 2, cy, tx + tw / 2, base], fill=_TREE)
        d.ellipse([tx - rx, cy - ry, tx + rx, cy + ry], fill=_TREE)
    for _ in range(int(rng.integers(1, 3))):  # cars: body + cabin + wheels
        cw, ch = rng.uniform(30, 56), rng.uniform(10, 16)
        x0 = rng.uniform(3, max(4.0, w - cw - 3))
        bottom = rng.uniform(y_floor + 6, h - 6)
        d.rectangle([x0, bottom - ch, x0 + cw, bottom], fill=_CAR)
        d.rectangle([x0 + 0.2 * cw, bottom - 1.8 * ch, x0 + 0.75 * cw, bottom - ch], fill=_CAR)
        wr = ch * 0.35
        for wx in (x0 + 0.22 * cw, x0 + 0.78 * cw):
            d.ellipse([wx - wr, bottom - wr, wx + wr, bottom + wr], fill=_CAR)
    if rng.random() < 0.5:  # a small unlabelled clutter blob
        bx, by = rng.uniform(0.1, 0.9) * w, rng.uniform(0.1, 0.9) * h
        br = rng.uniform(3, 7)
        d.ellipse([bx - br, by - br, bx + br, by + br], fill=0)
    d.rectangle([0, 0, w - 1, h - 1], outline=0, width=2)  # thin unlabelled border
    lab = np.asarray(lab_img, dtype=np.uint8).copy()

    palette = np.zeros((256, 3), np.float32)
    for v, c in ADE_COLOURS.items():
        palette[v] = np.asarray(c, np.float32) + rng.uniform(-15, 15, size=3)
    img = palette[lab]
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    sky = lab == _SKY
    img[sky] += (yy[sky] / h * 60.0)[:, None] * np.array([0.6, 0.4, 0.1], np.float32)
    floor = lab == _FLOOR
    period = rng.uniform(5, 10)
    img[floor] += (np.sin(2 * np.pi * (xx[floor] + 0.3 * yy[floor]) / period) * 10.0)[:, None]
    texture = (_smooth_field(rng, h, w, grid=8, channels=1) - 0.5) * 30.0
    img += texture + rng.normal(0, 7, size=(h, w, 3))
    return _to_uint8(img), lab


def _ade_files(num_train, num_val):
    files = []
    for split, num in (('train', num_train), ('val', num_val)):
        folder, prefix = _ADE_SPLITS[split]
        for i in range(num):
            files.append(f'ADEChallengeData2016/images/{folder}/{prefix}_{i + 1:08d}.jpg')
            files.append(f'ADEChallengeData2016/annotations/{folder}/{prefix}_{i + 1:08d}.png')
    return files


def _gen_ade(task_dir, seed, num_train, num_val):
    base = os.path.join(task_dir, 'ADEChallengeData2016')
    summary = {}
    for split, num in (('train', num_train), ('val', num_val)):
        folder, prefix = _ADE_SPLITS[split]
        counts = np.zeros(256, np.int64)
        for i in range(num):
            img, lab = _ade_image(_rng(seed, 'ade', split, i))
            name = f'{prefix}_{i + 1:08d}'
            _save_jpeg(img, os.path.join(base, 'images', folder, name + '.jpg'))
            _save_png_labels(lab, os.path.join(base, 'annotations', folder, name + '.png'))
            counts += np.bincount(lab.reshape(-1), minlength=256)
        summary[split] = dict(
            images=num, class_pixels={ADE_LABELS[v]: int(counts[v]) for v in sorted(ADE_LABELS)})
    return summary


# --------------------------------------------------------------------------------------------
# ImageNet
# --------------------------------------------------------------------------------------------
_IMAGENET_SIZE = 64


def _imagenet_image(rng, cls):
    n = _IMAGENET_SIZE
    yy, xx = np.mgrid[0:n, 0:n].astype(np.float32)
    period = rng.uniform(8, 16)
    phase = rng.uniform(0, period)
    if cls == 0:  # horizontal stripes
        on = ((yy + phase) % period) < period / 2
    elif cls == 1:  # vertical stripes
        on = ((xx + phase) % period) < period / 2
    elif cls == 2:  # checkerboard
        cell = period / 2
        on = (np.floor((xx + phase) / cell) + np.floor((yy + phase) / cell)) % 2 == 0
    else:  # concentric rings around a random centre
        cx, cy = rng.uniform(16, 48, size=2)
        r = np.sqrt((xx - cx)**2 + (yy - cy)**2)
        on = ((r + phase) % period) < period / 2
    fg = np.asarray(_IMAGENET_COLOURS[cls], np.float32) + rng.uniform(-25, 25, size=3)
    bg = rng.uniform(10, 90, size=3)
    img = np.where(on[..., None], fg, bg) + rng.normal(0, 10, size=(n, n, 3))
    return _to_uint8(img)


def _imagenet_rel(split, wnid, i):
    return f'{wnid}/{wnid}_{i:05d}.JPEG' if split == 'train' else f'{wnid}/{wnid}_val_{i:05d}.JPEG'


def _imagenet_files(num_train, num_val):
    files = ['meta/train.txt', 'meta/val.txt']
    for split, num in (('train', num_train), ('val', num_val)):
        for i in range(num):
            files.append(f'{split}/' + _imagenet_rel(split, IMAGENET_CLASSES[i % 4][0], i))
    return files


def _gen_imagenet(task_dir, seed, num_train, num_val):
    summary = {}
    for split, num in (('train', num_train), ('val', num_val)):
        lines = []
        per_class = {wnid: 0 for wnid, _, _ in IMAGENET_CLASSES}
        for i in range(num):
            cls = i % len(IMAGENET_CLASSES)
            wnid, label, _ = IMAGENET_CLASSES[cls]
            rel = _imagenet_rel(split, wnid, i)
            _save_jpeg(_imagenet_image(_rng(seed, 'imagenet', split, i), cls),
                       os.path.join(task_dir, split, rel))
            lines.append(f'{rel} {label}')
            per_class[wnid] += 1
        _write_text(lines, os.path.join(task_dir, 'meta', f'{split}.txt'))
        summary[split] = dict(images=num, per_class=per_class)
    return summary


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------
_GENERATORS = {
    'coco': (_gen_coco, _coco_files, ''),
    'ade': (_gen_ade, _ade_files, 'ADEChallengeData2016'),
    'imagenet': (_gen_imagenet, _imagenet_files, ''),
}


def _read_stamp(path):
    try:
        with open(path, encoding='utf-8') as f:
            stamp = json.load(f)
        return stamp if isinstance(stamp, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # present but unreadable: still ours, but never "up to date"


def _inside(base, rel):
    """Absolute path of ``rel`` if it lies strictly inside ``base``, else None."""
    base = os.path.realpath(base)
    full = os.path.realpath(os.path.join(base, rel))
    return full if full.startswith(base + os.sep) else None


def _remove_listed(task_dir, files):
    """Remove previously generated files (as listed in a stamp) and the folders they leave empty."""
    dirs = set()
    for rel in files:
        full = _inside(task_dir, rel) if isinstance(rel, str) else None
        if full is None:
            continue
        if os.path.isfile(full) or os.path.islink(full):
            os.remove(full)
        d = os.path.dirname(full)
        while d.startswith(os.path.realpath(task_dir) + os.sep):
            dirs.add(d)
            d = os.path.dirname(d)
    for d in sorted(dirs, key=len, reverse=True):
        try:
            os.rmdir(d)  # only succeeds when empty
        except OSError:
            pass


def _file_digest(task_dir, rel_files):
    """sha256 over (relative path, content hash) of every file, independent of where root is."""
    h = hashlib.sha256()
    for rel in rel_files:
        p = os.path.join(task_dir, *rel.split('/'))
        h.update(rel.encode() + b'\0')
        with open(p, 'rb') as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def make_demo_data(root='data/demo',
                   tasks=('coco', 'ade', 'imagenet'),
                   seed=0,
                   num_train=48,
                   num_val=16,
                   overwrite=False,
                   progress=True):
    """Generate the synthetic demo datasets under ``root``.

    Args:
        root (str): output root; task ``t`` is written to ``<root>/<t>/``.
        tasks (str | Sequence[str]): any of ``'coco'``, ``'ade'``, ``'imagenet'``.
        seed (int): random seed; same arguments give byte-identical files.
        num_train (int): images in the training split (per task).
        num_val (int): images in the validation split (per task).
        overwrite (bool): regenerate even if an up-to-date stamp exists, and allow writing into a
            non-empty task folder that carries no stamp (foreign files are never deleted).
        progress (bool): print one short line per task.

    Returns:
        dict: ``{'root': <abs root>, 'tasks': {task: {'path': <task folder>, 'data_root': <folder
        to use as data_root>, 'skipped': bool, 'files': [abs paths], 'digest': sha256 over the
        files, 'summary': {split: counts}}}}``.

    A task folder that already holds files but no ``.demo_stamp.json`` is considered foreign data
    and raises ``FileExistsError`` unless ``overwrite=True``. When a stamped task is regenerated,
    only the files listed in its stamp are removed, all of them inside the task folder.
    """
    if isinstance(tasks, str):
        tasks = (tasks, )
    tasks = tuple(tasks)
    unknown = [t for t in tasks if t not in _GENERATORS]
    if unknown:
        raise ValueError(f'unknown task(s) {unknown}; choose from {TASKS}')
    for name, val, low in (('num_train', num_train, 1), ('num_val', num_val, 1), ('seed', seed, 0)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < low:
            raise ValueError(f'{name} must be an int >= {low}, got {val!r}')
    seed, num_train, num_val = int(seed), int(num_train), int(num_val)

    root_abs = os.path.abspath(root)
    result = dict(root=root_abs, tasks={})
    for task in dict.fromkeys(tasks):  # de-duplicate, keep order
        gen, files_fn, data_sub = _GENERATORS[task]
        task_dir = os.path.join(root_abs, task)
        stamp_path = os.path.join(task_dir, STAMP_NAME)
        params = dict(
            generator='linattn_mm.demo_data',
            version=GENERATOR_VERSION,
            task=task,
            seed=seed,
            num_train=num_train,
            num_val=num_val)
        rel_files = files_fn(num_train, num_val)
        abs_files = [os.path.join(task_dir, *f.split('/')) for f in rel_files]
        t0 = time.perf_counter()

        stamp = _read_stamp(stamp_path)
        up_to_date = (
            not overwrite and stamp and stamp.get('complete') is True and 'summary' in stamp
            and stamp.get('params') == params and stamp.get('files') == rel_files
            and all(os.path.isfile(p) for p in abs_files))
        if up_to_date:
            summary, skipped = stamp['summary'], True
        else:
            if stamp is None and os.path.isdir(task_dir) and os.listdir(task_dir) and not overwrite:
                raise FileExistsError(
                    f'{task_dir} is not empty and has no {STAMP_NAME}; refusing to write demo data '
                    'into it (pass overwrite=True to write anyway)')
            if stamp:
                _remove_listed(task_dir, stamp.get('files') or [])
            os.makedirs(task_dir, exist_ok=True)
            # an in-progress stamp lists what will be written, so an interrupted run is cleaned up
            _write_json(dict(params=params, complete=False, files=rel_files), stamp_path)
            # JSON round trip: the same (sorted) structure whether generated now or read back later
            summary = gen(task_dir, seed, num_train, num_val)
            summary = json.loads(json.dumps(summary, sort_keys=True))
            _write_json(dict(params=params, complete=True, files=rel_files, summary=summary),
                        stamp_path)
            skipped = False
        elapsed = time.perf_counter() - t0
        result['tasks'][task] = dict(
            path=task_dir,
            data_root=os.path.join(task_dir, data_sub) if data_sub else task_dir,
            skipped=skipped,
            files=abs_files,
            digest=_file_digest(task_dir, rel_files),
            summary=summary)
        if progress:
            counts = ', '.join(
                f"{split} {s['images']} img" + (f", {s['annotations']} ann" if 'annotations' in s
                                                else '') for split, s in summary.items())
            state = 'up to date, skipped' if skipped else f'written in {elapsed:.1f}s'
            print(f'[demo_data] {task}: {counts} -> {task_dir} ({state})', flush=True)
    return result
