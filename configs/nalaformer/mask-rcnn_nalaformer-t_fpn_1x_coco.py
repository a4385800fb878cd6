# Mask R-CNN 1x with a NaLaFormer-T backbone. Paper recipe (Sec. 4.2 / App. A.2, FLatten strategy):
# AdamW lr 1e-4, weight decay 1e-4, step schedule, batch 2 x 8 GPUs.
_base_ = ['mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py', '../_base_/linattn_no_decay.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
# ImageNet-1k NaLaFormer-T weights. There are no public ones: train nalaformer-t_in1k (or
# place an official-format file, {'model': ..., 'model_ema': ...}, here; EMA weights are preferred).
pretrained = 'checkpoints/nalaformer_t.pth'
model = dict(
    backbone=dict(
        _delete_=True,
        type='NaLaFormer',
        arch='t',
        drop_path_rate=0.1,  # not stated in the paper; the ImageNet value
        out_indices=(0, 1, 2, 3),
        norm_eval=True,  # BatchNorm of the stem / patch merging frozen (2 images per GPU)
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[64, 128, 256, 512]))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-4),
    paramwise_cfg={{_base_.linattn_no_decay}})
