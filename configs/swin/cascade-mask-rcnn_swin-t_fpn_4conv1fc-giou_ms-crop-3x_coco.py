# Cascade Mask R-CNN 3x (4conv1fc GIoU heads, multi-scale + crop) with a Swin-T backbone,
# Swin paper recipe: AdamW lr 1e-4, wd 0.05, 36 epochs. Use --amp for mixed precision.
_base_ = [
    'mmdet::convnext/cascade-mask-rcnn_convnext-t-p4-w7_fpn_4conv1fc-giou_amp-ms-crop-3x_coco.py',
    '../_base_/linattn_no_decay.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone={{_base_.swin_t_backbone}},
    neck=dict(in_channels=[96, 192, 384, 768]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg={{_base_.linattn_no_decay}})
