# Semantic FPN, 40k iterations on ADE20K with a PVT-T backbone (PVT recipe: AdamW lr 2e-4,
# wd 1e-4, poly 0.9, batch 4 x 8 GPUs).
_base_ = [
    'mmseg::poolformer/fpn_poolformer_s12_8xb4-40k_ade20k-512x512.py',
    '../_base_/linattn_no_decay.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone={{_base_.pvt_t_backbone}},
    neck=dict(in_channels=[64, 128, 320, 512]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=2e-4, betas=(0.9, 0.999), weight_decay=0.0001),
    paramwise_cfg={{_base_.linattn_no_decay}})
