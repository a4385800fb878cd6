# Semantic FPN, 40k iterations on ADE20K with a SeTformer-T backbone (no paper result). PVT
# setting: poly schedule, 512x512 crops, batch 4 x 8 GPUs; AdamW lr 1e-4 (PVT), wd 0.01 (the
# paper's segmentation value). SeT: m=800, eps=0.3, tau=0.8.
_base_ = [
    'mmseg::poolformer/fpn_poolformer_s12_8xb4-40k_ade20k-512x512.py',
    '../_base_/linattn_no_decay.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone={{_base_.setformer_t_ade20k_backbone}},
    neck=dict(in_channels=[64, 128, 256, 512]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg={{_base_.setformer_no_decay}})
