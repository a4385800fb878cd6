# RetinaNet 1x with a NaLaFormer-S backbone. Paper recipe (Sec. 4.2 / App. A.2, FLatten strategy):
# AdamW lr 1e-4, weight decay 1e-4, step schedule, batch 2 x 8 GPUs.
_base_ = [
    'mmdet::pvt/retinanet_pvt-t_fpn_1x_coco.py',
    '../_base_/linattn_no_decay.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone={{_base_.nalaformer_s_backbone}},
    neck=dict(in_channels=[64, 128, 320, 512]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-4),
    paramwise_cfg={{_base_.linattn_no_decay}})
