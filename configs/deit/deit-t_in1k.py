# deit-t ImageNet-1k classifier (DeiT recipe: AdamW lr 1e-3 / 1024, 300 epochs).
_base_ = ['mmpretrain::deit/deit-tiny_4xb256_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnViT',
        arch='t',
        drop_path_rate=0.1,
        out_type='cls_token',
    ),
    head=dict(in_channels=192))
