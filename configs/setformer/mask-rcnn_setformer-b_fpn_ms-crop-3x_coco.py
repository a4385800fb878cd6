# Mask R-CNN 3x (multi-scale 480-800 + crop, 36 epochs) with a SeTformer-B backbone: the paper's
# setting (Table 4: 51.9 AP^b / 46.3 AP^m, 68M params, 351G FLOPs at 1280x800). Everything as
# mask-rcnn_setformer-t_fpn_ms-crop-3x_coco (AdamW 1e-4, wd 0.05, steps 27 / 33; SeT m=750,
# eps=0.3, tau=0.8) except the backbone: arch B (depths 3/4/18/5 with the NAT-B widths C=128, heads
# 4/8/16/32, MLP ratio 2, layer scale 1e-5: a reconstruction, the paper gives no widths, see
# docs/model_zoo/setformer.md), drop path 0.5 (the ImageNet value, as the T config).
_base_ = ['./mask-rcnn_setformer-t_fpn_ms-crop-3x_coco.py']
model = dict(
    backbone=dict(
        arch='b', drop_path_rate=0.5,
        init_cfg=dict(type='Pretrained', checkpoint={{_base_.setformer_b_pretrained}})),
    neck=dict(in_channels=[128, 256, 512, 1024]))
