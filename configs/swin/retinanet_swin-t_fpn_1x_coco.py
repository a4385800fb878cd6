# RetinaNet 1x with a Swin-T backbone (stock mmdet PVT recipe: AdamW lr 1e-4, wd 1e-4).
_base_ = ['mmdet::pvt/retinanet_pvt-t_fpn_1x_coco.py', '../_base_/linattn_no_decay.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
pretrained = 'https://github.com/SwinTransformer/storage/releases/download/v1.0.0/swin_tiny_patch4_window7_224.pth'  # official ImageNet-1k weights
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnSwin',
        arch='t',
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[96, 192, 384, 768]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0001),
    paramwise_cfg={{_base_.linattn_no_decay}})
