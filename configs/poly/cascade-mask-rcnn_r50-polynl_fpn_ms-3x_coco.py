# Cascade Mask R-CNN R50-FPN 3x with multi-scale training (stock mmdet recipe: SGD lr 0.02, 36
# epochs) with one Poly-NL block before the last residual block of res4 (not in the paper).
# Backbone: _base_/backbones.py.
_base_ = [
    'mmdet::cascade_rcnn/cascade-mask-rcnn_r50_fpn_ms-3x_coco.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(backbone={{_base_.r50_polynl_backbone}})
