# UperNet, 160k iterations on ADE20K with a SeTformer-S backbone: the paper's setting (Table 5:
# 51.1 / 51.9 mIoU SS / MS, 59M params, 986G FLOPs at 2048x512). Everything as
# upernet_setformer-t_8xb2-160k_ade20k-512x512 (AdamW 6e-5, wd 0.01, 1500-iter warm-up, linear
# decay; SeT m=800, eps=0.3, tau=0.8) except the backbone: arch S (depths 3/4/18/5 with the NAT-S
# widths C=96, heads 3/6/12/24, MLP ratio 2, layer scale 1e-5: a reconstruction, the paper gives
# no widths, see docs/model_zoo/setformer.md), drop path 0.3 (the ImageNet value, as the T config).
_base_ = ['./upernet_setformer-t_8xb2-160k_ade20k-512x512.py']
model = dict(
    backbone=dict(
        arch='s', drop_path_rate=0.3,
        init_cfg=dict(type='Pretrained', checkpoint={{_base_.setformer_s_pretrained}})),
    decode_head=dict(in_channels=[96, 192, 384, 768]),
    auxiliary_head=dict(in_channels=384))
