"""Helpers shared by the demo-data generators: per-image random generators, deterministic file
writers (same input -> byte-identical files) and a smooth random texture."""
import json
import os

import numpy as np
from PIL import Image

_TASK_CODE = {'coco': 1, 'ade': 2, 'imagenet': 3}
_SPLIT_CODE = {'train': 1, 'val': 2}
_JPEG_KW = dict(format='JPEG', quality=92, subsampling=0, optimize=False, progressive=False)
_PNG_KW = dict(format='PNG', compress_level=6, optimize=False)
#: bumped whenever the generated files change (recorded in every stamp and in the COCO JSON)
GENERATOR_VERSION = 1


def image_rng(seed, task, split, index):
    """Independent generator per (seed, task, split, image index)."""
    return np.random.default_rng([int(seed), _TASK_CODE[task], _SPLIT_CODE[split], int(index)])


def to_uint8(arr):
    return np.clip(np.rint(arr), 0, 255).astype(np.uint8)


def save_jpeg(arr, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(to_uint8(arr)).save(path, **_JPEG_KW)


def save_png_labels(lab, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(np.ascontiguousarray(lab, dtype=np.uint8)).save(path, **_PNG_KW)


def write_json(obj, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8', newline='\n') as f:
        json.dump(obj, f, sort_keys=True, separators=(',', ':'))
        f.write('\n')


def write_text(lines, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8', newline='\n') as f:
        f.write(''.join(line + '\n' for line in lines))


def smooth_field(rng, h, w, grid, channels=3):
    """Low-frequency random field in [0, 1] of shape (h, w, channels)."""
    small = rng.random((grid, grid, channels))
    chans = [
        np.asarray(
            Image.fromarray((small[..., c] * 255).astype(np.uint8)).resize((w, h), Image.BICUBIC),
            dtype=np.float32) / 255.0 for c in range(channels)
    ]
    return np.stack(chans, axis=-1)
