# UperNet, 160k iterations on ADE20K with a SeTformer-B backbone: the paper's setting (Table 5:
# 52.0 / 52.8 mIoU SS / MS, 81M params, 1008G FLOPs at 2048x512). Everything as
# upernet_setformer-t_8xb2-160k_ade20k-512x512 (AdamW 6e-5, wd 0.01, 1500-iter warm-up, linear
# decay; SeT m=800, eps=0.3, tau=0.8) except the backbone: arch B (depths 3/4/18/5 with the NAT-B
# widths C=128, heads 4/8/16/32, MLP ratio 2, layer scale 1e-5: a reconstruction, the paper gives
# no widths, see docs/model_zoo/setformer.md), drop path 0.5 (the ImageNet value, as the T config
# and NAT-B's UperNet).
_base_ = ['./upernet_setformer-t_8xb2-160k_ade20k-512x512.py']
model = dict(
    backbone=dict(
        arch='b', drop_path_rate=0.5,
        init_cfg=dict(type='Pretrained', checkpoint={{_base_.setformer_b_pretrained}})),
    decode_head=dict(in_channels=[128, 256, 512, 1024]),
    auxiliary_head=dict(in_channels=512))
