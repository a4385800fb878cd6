# Mask R-CNN 1x with a Pola-PVT-T backbone. Paper (App. A.2): mmdet, 12 epochs, AdamW lr 1e-4,
# wd 1e-4, 1333x800 single scale; Pola attention runs globally on the whole stage map with its
# position encodings resized to the input. Add --amp for mixed precision (the attention's feature
# maps stay in fp32).
_base_ = ['mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py', '../_base_/linattn_no_decay.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
pretrained = 'checkpoints/pola_pvt_t.pth'  # official ImageNet-1k Pola weights (HuggingFace ZachMeng/PolaFormer; no URL verified): put the file here
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnPVT',
        arch='t',
        attn_cfg=dict(type='PolaLinearAttention', qkv_layout='qg_kv', la_sr_ratio=1),
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[64, 128, 320, 512]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0001),
    paramwise_cfg={{_base_.linattn_no_decay}})
