# swin-t ImageNet-1k classifier (Swin recipe: AdamW lr 1e-3 / 1024, 300 epochs, mixup + cutmix).
_base_ = ['mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnSwin',
        arch='t',
        drop_path_rate=0.2,
        out_indices=(3, ),
    ),
    head=dict(in_channels=768))
