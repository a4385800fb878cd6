# UperNet, 160k iterations on ADE20K (512x512 crops) with a Poly-PVT-T backbone (Swin UperNet
# recipe: AdamW lr 6e-5, wd 0.01, 1500 warm-up iterations, poly decay, batch 2 x 8 GPUs).
# Poly-PVT-T is a plugin design (the paper has no PVT and no ADE20K result).
# Backbone: _base_/backbones.py (Poly-SA in every block).
_base_ = [
    'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py',
    '../_base_/linattn_no_decay.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone={{_base_.poly_pvt_t_backbone}},
    decode_head=dict(in_channels=[64, 128, 320, 512]),
    auxiliary_head=dict(in_channels=320))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg={{_base_.linattn_no_decay}})
