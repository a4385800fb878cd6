# Mask R-CNN 1x with a Pola-PVT-T backbone. Paper (App. A.2): mmdet, 12 epochs, AdamW lr 1e-4,
# wd 1e-4, 1333x800 single scale; Pola attention runs globally on the whole stage map with its
# position encodings resized to the input. Add --amp for mixed precision (the attention's feature
# maps stay in fp32).
_base_ = [
    'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py',
    '../_base_/linattn_no_decay.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone={{_base_.pola_pvt_t_backbone}},
    neck=dict(in_channels=[64, 128, 320, 512]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0001),
    paramwise_cfg={{_base_.linattn_no_decay}})
