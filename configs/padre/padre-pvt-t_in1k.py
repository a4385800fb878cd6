# PADRe-PVT-T ImageNet-1k classifier (plugin design, not in the paper): the PVT v1 skeleton with a
# degree-2 PADRe mixer in every stage instead of spatial-reduction attention (no spatial reduction:
# the cost is already linear in tokens; the arch's sr_ratios are ignored). PVT's per-stage absolute
# position embeddings are kept (resized to the input). Recipe: the Swin/PVT one (AdamW lr 1e-3 at
# batch 1024, wd 0.05, 300 epochs, DeiT-style augmentation); global average pooling of the last
# stage. No paper result; to be trained and reported by the team.
_base_ = ['mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnPVT',
        arch='t',
        attn_cfg=dict(type='PADReMixer', degree=2, kernel_size=11),  # or one per stage
        drop_path_rate=0.1,
        out_indices=(3, ),
    ),
    head=dict(in_channels=512))
