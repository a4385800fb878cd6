# PADRe-Swin-T ImageNet-1k classifier (plugin design, not in the paper): the Swin-T skeleton (patch
# merging, 4 stages, depths 2/2/6/2) with a degree-2 PADRe mixer in every block instead of (shifted)
# window attention: no window partition, no shift, no relative-position tables. Recipe: the stock
# Swin one (AdamW lr 1e-3 at batch 1024, wd 0.05, 300 epochs, 20 warm-up epochs, clip 5, DeiT-style
# augmentation). No paper result; to be trained and reported by the team.
_base_ = ['mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
padre_attn = dict(type='PADReMixer', degree=2, kernel_size=11)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnSwin',
        arch='t',
        attn_cfg=padre_attn,  # or a list of 4 per-stage configs
        drop_path_rate=0.2,
        out_indices=(3, ),
    ),
    head=dict(in_channels=768))
