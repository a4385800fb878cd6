# Mask R-CNN 1x (12 epochs, single scale) with a SeTformer-T backbone (no paper result). The
# paper's detection recipe: AdamW lr 1e-4, wd 0.05, batch 2 x 8 GPUs; steps at epochs 8 / 11.
# SeT: m=750, eps=0.3, tau=0.8.
_base_ = [
    'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py',
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
