# ResNet-50 + one Poly-NL block (reduction 4) right before the last residual block of res4, trained
# from scratch on ImageNet-1k with the paper's recipe (§5.1.2): SGD lr 0.1, momentum 0.9, wd 1e-4,
# batch 256 (8 GPUs x 32), 90 epochs (steps at 30 / 60 / 80, Goyal et al.).
# Paper, Table 1a: 76.30 top-1 / 93.06 top-5 (ResNet-50 75.62 / 92.68). No released weights.
_base_ = ['mmpretrain::resnet/resnet50_8xb32_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='PolyNLResNet',
        depth=50,
        polynl_cfg=dict(reduction=4),
        polynl_positions=[(2, -1)],
        pad_mask=None,  # classification crops have no padding
        out_indices=(3, ),
    ))
train_cfg = dict(max_epochs=90)
param_scheduler = dict(type='MultiStepLR', by_epoch=True, milestones=[30, 60, 80], gamma=0.1)
