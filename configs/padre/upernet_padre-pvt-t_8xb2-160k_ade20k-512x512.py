# UperNet, 160k iterations on ADE20K (512x512 crops) with a PADRe-PVT-T backbone (Swin UperNet
# recipe: AdamW lr 6e-5, wd 0.01, 1500 warm-up iterations, poly decay, batch 2 x 8 GPUs).
# PADRe-PVT-T is a plugin design (the paper has no hierarchical backbone and no ADE20K result).
# Degree-2 PADRe mixers in every stage; any input size works (no windows, no size-dependent tensors).
_base_ = [
    'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py',
    '../_base_/linattn_no_decay.py'
]
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
    decode_head=dict(in_channels=[64, 128, 320, 512]),
    auxiliary_head=dict(in_channels=320))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg={{_base_.linattn_no_decay}})
