# Semantic FPN, 40k iterations on ADE20K (512x512 crops) with a Poly-PVT-T backbone (PVT
# Semantic FPN recipe: AdamW lr 2e-4, wd 1e-4, poly decay 0.9, batch 4 x 8 GPUs).
# Poly-PVT-T is a plugin design (the paper has no PVT and no ADE20K result).
# Backbone: _base_/backbones.py (Poly-SA in every block).
_base_ = [
    'mmseg::poolformer/fpn_poolformer_s12_8xb4-40k_ade20k-512x512.py',
    '../_base_/linattn_no_decay.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone={{_base_.poly_pvt_t_backbone}},
    neck=dict(in_channels=[64, 128, 320, 512]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=2e-4, betas=(0.9, 0.999), weight_decay=0.0001),
    paramwise_cfg={{_base_.linattn_no_decay}})
