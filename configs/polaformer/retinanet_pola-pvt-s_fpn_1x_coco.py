# RetinaNet 1x with a Pola-PVT-S backbone (stock mmdet PVT recipe = paper App. A.2: 12 epochs,
# AdamW lr 1e-4, wd 1e-4, 1333x800). The PVT RetinaNet recipe trains with a static fp16 loss scale
# of 512 (mmdet 2.x fp16=dict(loss_scale=512.)); here: --amp, or optim_wrapper type
# 'AmpOptimWrapper' with loss_scale=512.
_base_ = [
    'mmdet::pvt/retinanet_pvt-t_fpn_1x_coco.py',
    '../_base_/linattn_no_decay.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone={{_base_.pola_pvt_s_backbone}},
    neck=dict(in_channels=[64, 128, 320, 512]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0001),
    paramwise_cfg={{_base_.linattn_no_decay}})
