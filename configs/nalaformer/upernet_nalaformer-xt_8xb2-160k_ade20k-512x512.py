# UperNet, 160k iterations on ADE20K with a NaLaFormer-XT backbone. The paper has no XT
# segmentation row: a convenience with the recipe of the T / S configs (Sec. 4.3): AdamW lr 1e-4,
# weight decay 1e-3; linear warm-up 1500 iterations then poly, 512x512 crops, batch 2 x 8 GPUs
# (Swin setting).
_base_ = [
    'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py',
    '../_base_/linattn_no_decay.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone={{_base_.nalaformer_xt_backbone}},
    decode_head=dict(in_channels=[32, 64, 128, 384]),
    auxiliary_head=dict(in_channels=128))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-3),
    paramwise_cfg={{_base_.linattn_no_decay}})
