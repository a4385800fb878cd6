# pvt-t ImageNet-1k classifier (PVT recipe (= DeiT/Swin): AdamW lr 1e-3 / 1024, 300 epochs).
_base_ = ['mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnPVT',
        arch='t',
        drop_path_rate=0.1,
        out_indices=(3, ),
    ),
    head=dict(in_channels=512))
