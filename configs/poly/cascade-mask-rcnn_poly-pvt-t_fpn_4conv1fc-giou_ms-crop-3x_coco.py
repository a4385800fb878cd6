# Cascade Mask R-CNN 3x (4conv1fc GIoU heads, multi-scale + crop, 36 epochs) with a Poly-PVT-T
# backbone; AdamW lr 1e-4, wd 1e-4 (PVT detection recipe).
# Poly-PVT-T is a plugin design (the paper has no PVT and no COCO result).
# Backbone: _base_/backbones.py (Poly-SA in every block).
# Use --amp for mixed precision (the Poly-SA pooling runs in float32).
_base_ = [
    'mmdet::convnext/cascade-mask-rcnn_convnext-t-p4-w7_fpn_4conv1fc-giou_amp-ms-crop-3x_coco.py',
    '../_base_/linattn_no_decay.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone={{_base_.poly_pvt_t_backbone}},
    neck=dict(in_channels=[64, 128, 320, 512]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0001),
    paramwise_cfg={{_base_.linattn_no_decay}})
