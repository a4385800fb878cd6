# Poly-DeiT-T ImageNet-1k classifier: DeiT-T with every softmax attention replaced by Poly-SA
# (Y = Q ⊙ p1 sigma(p2^T (K ⊙ V)), LayerNorm sigma, 3x3 depth-wise projection, p1 / p2 sized to the
# 14x14 grid plus the class token). Recipe: the stock DeiT 300-epoch one (paper §5.2.2: "each
# model's public recipe"). Paper, Table 3 ("DeiT Small", 5.4M params, i.e. the Tiny size): 71.48
# top-1 (softmax DeiT 72.16). No released weights.
_base_ = ['mmpretrain::deit/deit-tiny_4xb256_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnViT',
        arch='t',
        attn_cfg=dict(type='PolySelfAttention'),
        drop_path_rate=0.1,
        out_type='cls_token',
    ),
    head=dict(in_channels=192))
