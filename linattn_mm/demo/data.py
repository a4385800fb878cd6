"""Deterministic, small, synthetic demo datasets in three standard on-disk formats: the driver
(:func:`make_demo_data`); the images and annotations of each format are drawn in ``coco.py``,
``ade.py`` and ``imagenet.py``.

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

from . import ade, coco, imagenet
from .common import GENERATOR_VERSION, write_json

TASKS = ('coco', 'ade', 'imagenet')
STAMP_NAME = '.demo_stamp.json'
#: task -> its generator module (``generate``, ``file_list``, ``DATA_SUB``)
_GENERATORS = {'coco': coco, 'ade': ade, 'imagenet': imagenet}


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
        gen = _GENERATORS[task]
        task_dir = os.path.join(root_abs, task)
        stamp_path = os.path.join(task_dir, STAMP_NAME)
        params = dict(
            generator='linattn_mm.demo',
            version=GENERATOR_VERSION,
            task=task,
            seed=seed,
            num_train=num_train,
            num_val=num_val)
        rel_files = gen.file_list(num_train, num_val)
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
            write_json(dict(params=params, complete=False, files=rel_files), stamp_path)
            # JSON round trip: the same (sorted) structure whether generated now or read back later
            summary = gen.generate(task_dir, seed, num_train, num_val)
            summary = json.loads(json.dumps(summary, sort_keys=True))
            write_json(dict(params=params, complete=True, files=rel_files, summary=summary),
                        stamp_path)
            skipped = False
        elapsed = time.perf_counter() - t0
        result['tasks'][task] = dict(
            path=task_dir,
            data_root=os.path.join(task_dir, gen.DATA_SUB) if gen.DATA_SUB else task_dir,
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