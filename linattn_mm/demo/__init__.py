"""The demo: small synthetic datasets in the standard COCO, ADE20K and ImageNet layouts
(:func:`make_demo_data`, ``tools/make_demo_data.py``) and the overlay that puts any mmdet, mmseg
or mmpretrain config on them with a tiny schedule (:func:`apply_demo`; ``--demo`` of
``tools/train.py``, ``tools/test.py`` and ``tools/browse_dataset.py``; ``python -m linattn_mm.demo
CONFIG -o FILE`` for ``mim`` and the stock OpenMMLab tools).

Importing this package needs only numpy and Pillow; the overlay imports mmengine when it runs.
"""
from .ade import ADE_COLOURS, ADE_LABELS
from .coco import COCO_CATEGORIES, COCO_SHAPE_COLOURS, COCO_SHAPES
from .common import GENERATOR_VERSION
from .data import STAMP_NAME, TASKS, make_demo_data
from .imagenet import IMAGENET_CLASSES
from .overlay import (DEMO_ROOT, apply_demo, demo_config_text, demo_patch,
                      write_demo_config)

__all__ = [
    'make_demo_data', 'GENERATOR_VERSION', 'TASKS', 'STAMP_NAME', 'COCO_CATEGORIES', 'COCO_SHAPES',
    'COCO_SHAPE_COLOURS', 'ADE_LABELS', 'ADE_COLOURS', 'IMAGENET_CLASSES', 'DEMO_ROOT',
    'apply_demo', 'demo_patch', 'demo_config_text', 'write_demo_config'
]
