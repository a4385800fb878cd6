# Mask R-CNN R50-FPN with one Poly-NL block (reduction 4) right before the last residual block of
# res4: the paper's COCO recipe (§5.1.3): SGD lr 0.02, momentum 0.9, wd 1e-4, batch 16 (8 GPUs x 2
# images), 26 epochs with steps at epochs 16 and 22, horizontal flip only.
# Paper, Table 1b: 39.2 box AP / 35.4 mask AP (Mask R-CNN R50 baseline 37.9 / 34.6).
# Backbone: _base_/backbones.py (stock ImageNet ResNet-50 weights, Poly-NL starting as identity).
_base_ = [
    'mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(backbone={{_base_.r50_polynl_backbone}})
max_epochs = 26
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=500),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[16, 22],
         gamma=0.1),
]
