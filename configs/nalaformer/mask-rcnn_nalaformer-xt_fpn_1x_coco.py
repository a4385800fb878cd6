# Mask R-CNN 1x with a NaLaFormer-XT backbone. The paper has no XT detection row: a convenience
# with the recipe of the T / S configs (Sec. 4.2 / App. A.2, FLatten strategy): AdamW lr 1e-4,
# weight decay 1e-4, step schedule, batch 2 x 8 GPUs.
_base_ = [
    'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py',
    '../_base_/linattn_no_decay.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone={{_base_.nalaformer_xt_backbone}},
    neck=dict(in_channels=[32, 64, 128, 384]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-4),
    paramwise_cfg={{_base_.linattn_no_decay}})
