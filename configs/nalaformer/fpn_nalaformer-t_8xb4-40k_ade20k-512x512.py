# Semantic FPN, 40k iterations on ADE20K with a NaLaFormer-T backbone. Paper recipe (Sec. 4.3):
# AdamW lr 1e-4, weight decay 1e-3; poly schedule, 512x512 crops, batch 4 x 8 GPUs (PVT setting).
_base_ = [
    'mmseg::poolformer/fpn_poolformer_s12_8xb4-40k_ade20k-512x512.py',
    '../_base_/linattn_no_decay.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone={{_base_.nalaformer_t_backbone}},
    neck=dict(in_channels=[64, 128, 256, 512]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-3),
    paramwise_cfg={{_base_.linattn_no_decay}})
