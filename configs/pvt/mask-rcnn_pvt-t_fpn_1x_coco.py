# Mask R-CNN 1x with a PVT-T backbone (stock mmdet Swin recipe: AdamW lr 1e-4).
_base_ = ['mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py', '../_base_/linattn_no_decay.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
pretrained = 'https://github.com/whai362/PVT/releases/download/v2/pvt_tiny.pth'  # official ImageNet-1k weights
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnPVT',
        arch='t',
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[64, 128, 320, 512]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0001),
    paramwise_cfg={{_base_.linattn_no_decay}})
