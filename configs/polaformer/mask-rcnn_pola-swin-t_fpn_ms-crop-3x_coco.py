# Mask R-CNN 3x (36 epochs, steps 27/33, multi-scale 480-800 + crop augmentation of Swin) with a
# Pola-Swin-T backbone; AdamW lr 1e-4, wd 0.05 (see mask-rcnn_pola-swin-t_fpn_1x_coco).
_base_ = ['mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py', '../_base_/linattn_no_decay.py']
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
    neck=dict(in_channels=[96, 192, 384, 768]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg={{_base_.linattn_no_decay}})
