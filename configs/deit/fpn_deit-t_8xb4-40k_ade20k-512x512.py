# Semantic FPN, 40k iterations on ADE20K with a DeiT-T backbone (PVT recipe: AdamW lr 2e-4,
# wd 1e-4, poly 0.9, batch 4 x 8 GPUs).
_base_ = ['mmseg::poolformer/fpn_poolformer_s12_8xb4-40k_ade20k-512x512.py', '../_base_/linattn_no_decay.py']
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
    optimizer=dict(type='AdamW', lr=2e-4, betas=(0.9, 0.999), weight_decay=0.0001),
    paramwise_cfg={{_base_.linattn_no_decay}})
