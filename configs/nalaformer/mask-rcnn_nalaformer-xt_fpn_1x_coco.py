# Mask R-CNN 1x with a NaLaFormer-XT backbone. The paper has no XT detection row: a convenience
# with the recipe of the T config (Sec. 4.2 / App. A.2, FLatten strategy); drop path 0.1 is the
# ImageNet value of both sizes.
_base_ = './mask-rcnn_nalaformer-t_fpn_1x_coco.py'
model = dict(
    backbone=dict(arch='xt', init_cfg=dict(checkpoint={{_base_.nalaformer_xt_pretrained}})),
    neck=dict(in_channels=[32, 64, 128, 384]))
