# UperNet, 160k iterations on ADE20K (512x512 crops) with a Pola-Swin-T backbone. Swin recipe:
# AdamW lr 6e-5, wd 0.01, linear warm-up 1500 iterations, poly decay, batch 2 x 8 GPUs (the paper's
# "lr 2e-4, wd 1e-3" is stated for segmentation in general and matches neither standard recipe).
_base_ = [
    'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py',
    '../_base_/linattn_no_decay.py'
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
pretrained = 'checkpoints/pola_swin_t.pth'  # official ImageNet-1k Pola weights (HuggingFace ZachMeng/PolaFormer; no URL verified): put the file here
# Stages 1-2: global Pola attention on the whole map (the official window 56 is the whole map at
# 224; at 1333x800 the stage-1 map is ~200x334, O(N d^2)); position encodings resized to the input.
# Stages 3-4: Swin window-7 (shifted) softmax attention.
pola_attn = dict(type='PolaLinearAttention', qkv_layout='qkvg', alpha=4, kernel_size=5)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnSwin',
        arch='t',
        attn_cfg=[
            pola_attn, pola_attn,
            dict(type='WindowSoftmaxAttention', window_size=7),
            dict(type='WindowSoftmaxAttention', window_size=7),
        ],
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    decode_head=dict(in_channels=[96, 192, 384, 768]),
    auxiliary_head=dict(in_channels=384))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg={{_base_.linattn_no_decay}})
