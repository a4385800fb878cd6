# RetinaNet R50-FPN 1x (stock mmdet recipe: SGD lr 0.01, 12 epochs) with one Poly-NL block before
# the last residual block of res4 (not in the paper, which reports Mask R-CNN only).
# Backbone: _base_/backbones.py.
_base_ = [
    'mmdet::retinanet/retinanet_r50_fpn_1x_coco.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(backbone={{_base_.r50_polynl_backbone}})
