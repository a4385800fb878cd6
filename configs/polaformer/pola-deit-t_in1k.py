# Pola-DeiT-T ImageNet-1k classifier: DeiT-T with polarity-aware linear attention in every block
# (one qkvg projection, as the Swin form). The class token takes part in q/k/v and the gate but not
# in the DWC (grid only). No per-block position encoding (use_pos_enc=False: DeiT already adds an
# absolute pos_embed, and only this matches the paper's 6.1M parameters; no official Pola-DeiT code
# was released). Recipe: the stock DeiT one (AdamW lr 1e-3 at batch 1024, wd 0.05, 300 epochs,
# DeiT augmentation). 6.19M params, 74.6 top-1 (paper, Table 1).
_base_ = ['mmpretrain::deit/deit-tiny_4xb256_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnViT',
        arch='t',
        attn_cfg=dict(type='PolaLinearAttention', qkv_layout='qkvg', use_pos_enc=False),
        drop_path_rate=0.1,
        out_type='cls_token',
    ),
    head=dict(in_channels=192))
