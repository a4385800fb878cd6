"""The demo: small synthetic datasets in the standard COCO, ADE20K and ImageNet layouts
(:func:`make_demo_data`, ``tools/make_demo_data.py``).

Importing this package needs only numpy and Pillow.
"""
from .ade import ADE_COLOURS, ADE_LABELS
from .coco import COCO_CATEGORIES, COCO_SHAPE_COLOURS, COCO_SHAPES
from .common import GENERATOR_VERSION
from .data import STAMP_NAME, TASKS, make_demo_data
from .imagenet import IMAGENET_CLASSES

__all__ = [
    'make_demo_data', 'GENERATOR_VERSION', 'TASKS', 'STAMP_NAME', 'COCO_CATEGORIES', 'COCO_SHAPES',
    'COCO_SHAPE_COLOURS', 'ADE_LABELS', 'ADE_COLOURS', 'IMAGENET_CLASSES'
]
