"""The ImageNet-layout demo data (``train/<wnid>/``, ``val/<wnid>/``, ``meta/{train,val}.txt``):
four real ImageNet-1k classes with their true indices, each a distinct 64x64 pattern and colour
family."""
import os

import numpy as np

from .common import image_rng, save_jpeg, to_uint8, write_text

#: the data root is the task folder itself
DATA_SUB = ''

#: (wnid, ImageNet-1k index, name) of the four demo classes.
IMAGENET_CLASSES = (
    ('n01440764', 0, 'tench'),
    ('n01443537', 1, 'goldfish'),
    ('n01484850', 2, 'great white shark'),
    ('n01491361', 3, 'tiger shark'),
)
# pattern foreground colour per class (background is a dark version of a random colour)
_IMAGENET_COLOURS = ((225, 130, 40), (230, 205, 45), (60, 110, 210), (150, 60, 190))

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
    return to_uint8(img)


def _imagenet_rel(split, wnid, i):
    return f'{wnid}/{wnid}_{i:05d}.JPEG' if split == 'train' else f'{wnid}/{wnid}_val_{i:05d}.JPEG'


def file_list(num_train, num_val):
    files = ['meta/train.txt', 'meta/val.txt']
    for split, num in (('train', num_train), ('val', num_val)):
        for i in range(num):
            files.append(f'{split}/' + _imagenet_rel(split, IMAGENET_CLASSES[i % 4][0], i))
    return files


def generate(task_dir, seed, num_train, num_val):
    summary = {}
    for split, num in (('train', num_train), ('val', num_val)):
        lines = []
        per_class = {wnid: 0 for wnid, _, _ in IMAGENET_CLASSES}
        for i in range(num):
            cls = i % len(IMAGENET_CLASSES)
            wnid, label, _ = IMAGENET_CLASSES[cls]
            rel = _imagenet_rel(split, wnid, i)
            save_jpeg(_imagenet_image(image_rng(seed, 'imagenet', split, i), cls),
                       os.path.join(task_dir, split, rel))
            lines.append(f'{rel} {label}')
            per_class[wnid] += 1
        write_text(lines, os.path.join(task_dir, 'meta', f'{split}.txt'))
        summary[split] = dict(images=num, per_class=per_class)
    return summary
