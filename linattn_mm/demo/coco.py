"""The COCO 2017 instance-format demo data: 1-4 non-overlapping filled shapes per image on a
textured background, each shape a real COCO category (circle -> 'sports ball', triangle -> 'kite',
square -> 'tv'); the JSON lists all 80 COCO 2017 categories with their real ids."""
import os

import numpy as np
from PIL import Image, ImageDraw

from .common import GENERATOR_VERSION, image_rng, save_jpeg, smooth_field, to_uint8, write_json

#: the data root is the task folder itself
DATA_SUB = ''

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
    field = smooth_field(rng, h, w, grid=int(rng.integers(3, 7)))
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
    return to_uint8(img), objects


def _coco_split(task_dir, split, seed, num):
    folder = f'{split}2017'
    images, annotations = [], []
    per_cat = {name: 0 for name in sorted(COCO_SHAPES.values())}
    ann_id = 0
    for i in range(num):
        image_id = i + 1
        file_name = f'{image_id:012d}.jpg'
        arr, objects = _coco_image(image_rng(seed, 'coco', split, i))
        h, w = arr.shape[:2]
        save_jpeg(arr, os.path.join(task_dir, folder, file_name))
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
            contributor='linattn_mm.demo',
            url='',
            date_created=''),
        licenses=[],
        images=images,
        annotations=annotations,
        categories=COCO_CATEGORIES)
    write_json(coco, os.path.join(task_dir, 'annotations', f'instances_{split}2017.json'))
    return dict(images=len(images), annotations=len(annotations), per_category=per_cat)


def file_list(num_train, num_val):
    files = ['annotations/instances_train2017.json', 'annotations/instances_val2017.json']
    files += [f'train2017/{i + 1:012d}.jpg' for i in range(num_train)]
    files += [f'val2017/{i + 1:012d}.jpg' for i in range(num_val)]
    return files


def generate(task_dir, seed, num_train, num_val):
    return dict(
        train=_coco_split(task_dir, 'train', seed, num_train),
        val=_coco_split(task_dir, 'val', seed, num_val))
