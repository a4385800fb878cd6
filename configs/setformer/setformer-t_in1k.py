# SeTformer-T ImageNet-1k classifier. Paper: "Swin as our baseline" recipe: AdamW, 300 epochs
# (the text says "iterations"), 20 warm-up epochs, cosine decay, 224x224, batch 1024; SeT with
# m=500 references, eps=0.1, tau=0.5. Here the stock mmpretrain Swin-T recipe (AdamW lr 1e-3 at
# batch 1024, wd 0.05, clip 5, RandAugment, mixup 0.8 / cutmix 1.0, label smoothing 0.1, random
# erasing 0.25); the paper's 10 cool-down epochs are not in the stock schedule.
# Backbone: NAT macro design (depths 3/4/18/5 of the paper; C=64, heads 2/4/8/16, MLP ratio 3,
# drop path 0.2 from NAT-T, the paper gives none), global SeT attention in every block.
# Paper: 22.3M params, 4.1G FLOPs, 83.9 top-1. This model: 26.64M parameters (22.71M without the
# 3.94M learnable references; refs_learnable=False makes them K-means buffers).
_base_ = ['mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
set_attn = dict(type='SeTAttention', num_refs=500, eps=0.1, tau=0.5, num_iters=30)
model = dict(
    backbone=dict(
        _delete_=True,
        type='SeTformer',
        arch='t',
        attn_cfg=set_attn,  # or a list of 4 per-stage configs
        drop_path_rate=0.2,
        out_indices=(3, ),
    ),
    head=dict(in_channels=512))
# the references (and Nystrom anchors) are normalised by the kernel: no weight decay on them
optim_wrapper = dict(
    paramwise_cfg=dict(custom_keys={
        'refs': dict(decay_mult=0.0),
        'anchors': dict(decay_mult=0.0)
    }))
