# Pola-Swin-T ImageNet-1k classifier (official attn type LLSS, window 56): stages 1-2 global
# polarity-aware linear attention (window 56 covers the whole 56x56 / 28x28 map at 224), stages 3-4
# Swin window-7 softmax attention. At 224 the official stage-4 map (7x7) is not larger than the
# window, so the official code does not shift it: shift=False there reproduces the official model
# exactly at the classification resolution. Recipe: the stock Swin one (AdamW lr 1e-3 at batch
# 1024, wd 0.05, 300 epochs, 20 warm-up epochs, clip 5, DeiT-style augmentation).
# 29.29M params, 82.6 top-1 (paper).
_base_ = ['mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
pola_attn = dict(type='PolaLinearAttention', qkv_layout='qkvg', alpha=4, kernel_size=5)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnSwin',
        arch='t',
        attn_cfg=[
            pola_attn, pola_attn,
            dict(type='WindowSoftmaxAttention', window_size=7),
            dict(type='WindowSoftmaxAttention', window_size=7, shift=False),
        ],
        drop_path_rate=0.2,
        out_indices=(3, ),
    ),
    head=dict(in_channels=768))
