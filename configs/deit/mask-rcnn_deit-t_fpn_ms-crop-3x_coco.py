# Mask R-CNN ms-crop-3x with a DeiT-T backbone (stock mmdet Swin recipe: AdamW lr 1e-4).
_base_ = ['mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py', '../_base_/linattn_no_decay.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
pretrained = 'https://dl.fbaipublicfiles.com/deit/deit_tiny_patch16_224-a1311bcf.pth'  # official ImageNet-1k weights
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnViT',
        arch='t',
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[192, 192, 192, 192]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg={{_base_.linattn_no_decay}})
