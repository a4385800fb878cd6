# UperNet R50, 160k iterations on ADE20K (stock mmseg recipe: SGD lr 0.01, batch 4 x 4 GPUs) with
# one Poly-NL block before the last residual block of res4 (not in the paper). The backbone is a
# ResNet-50 v1 (torchvision names and weights) instead of mmseg's v1c deep stem.
# Backbone: _base_/backbones.py.
_base_ = [
    'mmseg::upernet/upernet_r50_4xb4-160k_ade20k-512x512.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(pretrained=None, backbone={{_base_.r50_polynl_backbone}})
