# UperNet, 160k iterations on ADE20K with a NaLaFormer-XT backbone. The paper has no XT
# segmentation row: a convenience with the recipe of the T config (Sec. 4.3); drop path 0.1 is the
# ImageNet value of both sizes.
_base_ = './upernet_nalaformer-t_8xb2-160k_ade20k-512x512.py'
model = dict(
    backbone=dict(arch='xt', init_cfg=dict(checkpoint={{_base_.nalaformer_xt_pretrained}})),
    decode_head=dict(in_channels=[32, 64, 128, 384]),
    auxiliary_head=dict(in_channels=128))
