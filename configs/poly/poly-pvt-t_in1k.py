# Poly-PVT-T ImageNet-1k classifier (plugin design; the paper has no PVT): the PVT v1 skeleton with
# Poly-SA in every block, K / V on PVT's spatially reduced grid (sr_ratios 8/4/2/1; p2 sized to the
# reduced grid, p1 to the full one). Recipe: the Swin/PVT one (AdamW lr 1e-3 at batch 1024, wd
# 0.05, 300 epochs). No paper result; to be trained and reported by the team.
_base_ = ['mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnPVT',
        arch='t',
        attn_cfg=dict(type='PolySelfAttention'),
        drop_path_rate=0.1,
        out_indices=(3, ),
    ),
    head=dict(in_channels=512))
