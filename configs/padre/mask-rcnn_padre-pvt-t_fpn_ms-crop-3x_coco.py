# Mask R-CNN 3x (36 epochs, multi-scale 480-800 + crop, Swin recipe) with a PADRe-PVT-T backbone;
# AdamW lr 1e-4, wd 1e-4 (PVT detection recipe).
# PADRe-PVT-T is a plugin design (the paper has no hierarchical backbone and no COCO result).
# Degree-2 PADRe mixers in every stage; any input size works (no windows, no size-dependent tensors).
# Use --amp for mixed precision (the PADRe products run in float32).
_base_ = ['mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py', '../_base_/linattn_no_decay.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
pretrained = 'checkpoints/padre_pvt-t.pth'  # ImageNet-1k weights from configs/padre/padre-pvt-t_in1k.py (no released PADRe weights): put the file here
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnPVT',
        arch='t',
        attn_cfg=dict(type='PADReMixer', degree=2, kernel_size=11),
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[64, 128, 320, 512]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0001),
    paramwise_cfg={{_base_.linattn_no_decay}})
