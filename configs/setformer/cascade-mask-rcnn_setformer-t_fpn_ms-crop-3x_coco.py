# Cascade Mask R-CNN 3x (multi-scale + crop, 36 epochs) with a SeTformer-T backbone: the paper's
# setting (Table 14: 52.9 AP^b / 46.2 AP^m). Heads: 4conv1fc with GIoU loss, as the Swin / ConvNeXt
# / NAT Cascade 3x baselines the paper compares with. AdamW lr 1e-4, wd 0.05 (paper), batch 2 x 8
# GPUs, steps at epochs 27 / 33. SeT: m=750, eps=0.3, tau=0.8. Use --amp for mixed precision (the
# SeT core stays float32).
_base_ = [
    'mmdet::convnext/cascade-mask-rcnn_convnext-t-p4-w7_fpn_4conv1fc-giou_amp-ms-crop-3x_coco.py',
    '../_base_/linattn_no_decay.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone={{_base_.setformer_t_coco_backbone}},
    neck=dict(in_channels=[64, 128, 256, 512]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg={{_base_.setformer_no_decay}})
