"""The ADE20K-format demo data
(``ADEChallengeData2016/{images,annotations}/{training,validation}``): street scenes of wall, sky,
floor, trees and cars. Label PNGs are single-channel uint8 with the ADE20K PNG values (0 =
other/unlabelled, ignored with ``reduce_zero_label=True``)."""
import os

import numpy as np
from PIL import Image, ImageDraw

from .common import image_rng, save_jpeg, save_png_labels, smooth_field, to_uint8

#: the data root is this sub-folder of the task folder
DATA_SUB = 'ADEChallengeData2016'

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
    texture = (smooth_field(rng, h, w, grid=8, channels=1) - 0.5) * 30.0
    img += texture + rng.normal(0, 7, size=(h, w, 3))
    return to_uint8(img), lab


def file_list(num_train, num_val):
    files = []
    for split, num in (('train', num_train), ('val', num_val)):
        folder, prefix = _ADE_SPLITS[split]
        for i in range(num):
            files.append(f'{DATA_SUB}/images/{folder}/{prefix}_{i + 1:08d}.jpg')
            files.append(f'{DATA_SUB}/annotations/{folder}/{prefix}_{i + 1:08d}.png')
    return files


def generate(task_dir, seed, num_train, num_val):
    base = os.path.join(task_dir, DATA_SUB)
    summary = {}
    for split, num in (('train', num_train), ('val', num_val)):
        folder, prefix = _ADE_SPLITS[split]
        counts = np.zeros(256, np.int64)
        for i in range(num):
            img, lab = _ade_image(image_rng(seed, 'ade', split, i))
            name = f'{prefix}_{i + 1:08d}'
            save_jpeg(img, os.path.join(base, 'images', folder, name + '.jpg'))
            save_png_labels(lab, os.path.join(base, 'annotations', folder, name + '.png'))
            counts += np.bincount(lab.reshape(-1), minlength=256)
        summary[split] = dict(
            images=num, class_pixels={ADE_LABELS[v]: int(counts[v]) for v in sorted(ADE_LABELS)})
    return summary
