# Pola-PVT-T ImageNet-1k classifier: PVT-T with polarity-aware linear attention in every stage and
# full-resolution K/V (official la_sr_ratios 1111, attn type LLLL). Recipe (paper App. A.2 / the
# official Swin-style trainer): AdamW lr 1e-3 at batch 1024, wd 0.05, 300 epochs, 20 warm-up
# epochs, DeiT-style augmentation (RandAugment, mixup 0.8, cutmix 1.0, label smoothing 0.1,
# random erasing). Classification readout as in the official model: mean of the last stage's
# tokens (no final norm) -> linear head. 12.92M params (with head), 78.8 top-1 (paper).
_base_ = ['mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnPVT',
        arch='t',
        attn_cfg=dict(type='PolaLinearAttention', qkv_layout='qg_kv', alpha=4, kernel_size=5,
                      la_sr_ratio=1),
        drop_path_rate=0.1,
        out_indices=(3, ),
    ),
    head=dict(in_channels=512))
