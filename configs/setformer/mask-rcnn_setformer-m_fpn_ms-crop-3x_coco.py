# Mask R-CNN 3x (multi-scale 480-800 + crop, 36 epochs) with a SeTformer-M backbone: the paper's
# setting (Table 4: 46.7 AP^b / 41.9 AP^m, 32M params, 190G FLOPs at 1280x800). Everything as
# mask-rcnn_setformer-t_fpn_ms-crop-3x_coco (AdamW 1e-4, wd 0.05, steps 27 / 33; SeT m=750,
# eps=0.3, tau=0.8) except the backbone: arch M (depths 3/4/6/5, C=64, heads 2/4/8/16, MLP ratio
# 3), drop path 0.2 (not stated in the paper; the ImageNet (NAT-Mini) value, as the T config).
_base_ = ['./mask-rcnn_setformer-t_fpn_ms-crop-3x_coco.py']
model = dict(
    backbone=dict(
        arch='m', drop_path_rate=0.2,
        init_cfg=dict(type='Pretrained', checkpoint={{_base_.setformer_m_pretrained}})),
    neck=dict(in_channels=[64, 128, 256, 512]))
