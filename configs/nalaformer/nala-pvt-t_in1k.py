# NaLa-PVT-T ImageNet-1k classifier: the PVT-T skeleton with norm-aware linear attention in all four
# stages on full-resolution keys/values (no spatial reduction), as Pola-PVT / FLatten-PVT; PVT
# recipe (AdamW lr 1e-3 / 1024, 300 epochs, drop path 0.1). Not reported in the NaLaFormer paper.
_base_ = ['mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnPVT',
        arch='t',
        attn_cfg=dict(type='NormAwareLinearAttention'),
        drop_path_rate=0.1,
        out_indices=(3, )),
    head=dict(in_channels=512))
