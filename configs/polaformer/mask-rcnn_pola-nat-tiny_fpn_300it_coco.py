# The main demo (tools/demo.sh, which runs it with --demo): Mask R-CNN whose backbone is a tiny
# NAT-style hierarchy (the conv stem and conv downsamplers of SeTformer, one block per stage and two
# in stage 3, widths 32/64/128/256) with PolaFormer's polarity-aware linear attention in every
# block, trained from scratch for 300 iterations (2.5 minutes on 2 CPU cores on the demo data).
# Any mixer fits any skeleton; a conv stem learns from scratch within this budget, the patchify
# stems of Swin / PVT need ImageNet weights (see the learning check in docs/fidelity.md, whose
# recipe this is: narrow heads, AdamW lr 1e-3, warm-up then cosine decay, no gradient clipping).
# The recipe is this config's own: the demo overlay leaves the keys in demo_keep as they are and
# brings the data, the two-stage CPU settings and no pretrained file.
_base_ = ['../setformer/mask-rcnn_setformer-t_fpn_1x_coco.py']
iters = 300
warmup = 30
model = dict(
    backbone=dict(
        arch=dict(_delete_=True, embed_dims=32, depths=[1, 1, 2, 1], num_heads=[1, 2, 4, 8],
                  mlp_ratio=3., drop_path_rate=0.2, layer_scale_init_value=None),
        attn_cfg=dict(_delete_=True, type='PolaLinearAttention', qkv_layout='qkvg', alpha=4,
                      kernel_size=5),
        init_cfg=None),
    neck=dict(in_channels=[32, 64, 128, 256], out_channels=64),
    rpn_head=dict(in_channels=64, feat_channels=64),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=64),
        bbox_head=dict(in_channels=64, fc_out_channels=256),
        mask_roi_extractor=dict(out_channels=64),
        mask_head=dict(in_channels=64, conv_out_channels=64, num_convs=2)))
optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=warmup),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=warmup, end=iters,
         T_max=iters - warmup, eta_min=0.0)
]
train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=iters, val_interval=iters)
train_dataloader = dict(sampler=dict(type='InfiniteSampler', shuffle=True))
log_processor = dict(by_epoch=False)
default_hooks = dict(logger=dict(interval=10),
                     checkpoint=dict(by_epoch=False, interval=iters, max_keep_ckpts=1))
demo_keep = ['optim_wrapper', 'param_scheduler', 'train_cfg', 'default_hooks']
