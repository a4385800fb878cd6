# Pola-PVTv2-b0 ImageNet-1k classifier: PVTv2 with polarity-aware linear attention in every stage,
# full-resolution K/V (la_sr_ratio 1, as the parent FLatten-PVTv2 code run with its default
# PVT_LA_SR_RATIOS=1111) and no per-block position encoding (use_pos_enc=False: PVTv2 has no
# absolute position embedding, and only this choice matches the paper's 3.4M / 13M parameters for
# b0 / b1; no official Pola-PVTv2 code was released). Same recipe as pola-pvt-t.
# 3.40M params, 72.3 top-1 (paper).
_base_ = ['mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnPVTv2',
        arch='b0',
        attn_cfg=dict(type='PolaLinearAttention', qkv_layout='qg_kv', la_sr_ratio=1,
                      use_pos_enc=False),
        drop_path_rate=0.1,
        out_indices=(3, ),
    ),
    head=dict(in_channels=256))
