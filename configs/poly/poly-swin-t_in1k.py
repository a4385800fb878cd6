# Poly-Swin-T ImageNet-1k classifier: Swin-T with every (shifted) window attention replaced by
# Poly-SA pooling inside the 7x7 windows (a shifted window pools each shift region separately; no
# relative-position tables), LayerNorm sigma, 3x3 depth-wise projection. Recipe: the stock Swin one
# (AdamW lr 1e-3 at batch 1024, wd 0.05, 300 epochs). Paper, Table 3: 26.1M params, 80.66 top-1
# (Swin-T 81.28). No released weights.
_base_ = ['mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnSwin',
        arch='t',
        attn_cfg=dict(type='PolySelfAttention', window_size=7),
        drop_path_rate=0.2,
        out_indices=(3, ),
    ),
    head=dict(in_channels=768))
