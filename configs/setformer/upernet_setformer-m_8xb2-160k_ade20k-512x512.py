# UperNet, 160k iterations on ADE20K with a SeTformer-M backbone: the paper's setting (Table 5:
# 45.8 / 46.9 mIoU SS / MS, 40M params, 758G FLOPs at 2048x512). Everything as
# upernet_setformer-t_8xb2-160k_ade20k-512x512 (AdamW 6e-5, wd 0.01, 1500-iter warm-up, linear
# decay; SeT m=800, eps=0.3, tau=0.8) except the backbone: arch M (depths 3/4/6/5, C=64, heads
# 2/4/8/16, MLP ratio 3), drop path 0.2 (not stated in the paper; the ImageNet (NAT-Mini) value,
# as the T config).
_base_ = ['./upernet_setformer-t_8xb2-160k_ade20k-512x512.py']
model = dict(
    backbone=dict(
        arch='m', drop_path_rate=0.2,
        init_cfg=dict(type='Pretrained', checkpoint={{_base_.setformer_m_pretrained}})),
    decode_head=dict(in_channels=[64, 128, 256, 512]),
    auxiliary_head=dict(in_channels=256))
