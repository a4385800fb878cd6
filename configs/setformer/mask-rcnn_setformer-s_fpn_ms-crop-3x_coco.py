# Mask R-CNN 3x (multi-scale 480-800 + crop, 36 epochs) with a SeTformer-S backbone: the paper's
# setting (Table 4: 51.3 AP^b / 45.9 AP^m, 52M params, 312G FLOPs at 1280x800). Everything as
# mask-rcnn_setformer-t_fpn_ms-crop-3x_coco (AdamW 1e-4, wd 0.05, steps 27 / 33; SeT m=750,
# eps=0.3, tau=0.8) except the backbone: arch S (depths 3/4/18/5 with the NAT-S widths C=96, heads
# 3/6/12/24, MLP ratio 2, layer scale 1e-5: a reconstruction, the paper gives no widths, see
# docs/model_zoo/setformer.md), drop path 0.3 (the ImageNet value, as the T config; NAT's own
# Mask R-CNN uses 0.35).
_base_ = ['./mask-rcnn_setformer-t_fpn_ms-crop-3x_coco.py']
model = dict(
    backbone=dict(
        arch='s', drop_path_rate=0.3,
        init_cfg=dict(type='Pretrained', checkpoint={{_base_.setformer_s_pretrained}})),
    neck=dict(in_channels=[96, 192, 384, 768]))
