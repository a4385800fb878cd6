# UperNet, 160k iterations on ADE20K with a SeTformer-T backbone: the paper's setting (Table 5:
# 50.6 / 51.4 mIoU SS / MS; the main text says "160K epochs"). AdamW lr 6e-5, wd 0.01, 1500-iter
# linear warm-up then linear (poly 1.0) decay, 512x512 crops, batch 2 x 8 GPUs (Swin setting).
# SeT: m=800, eps=0.3, tau=0.8.
_base_ = [
    'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py',
    '../_base_/linattn_no_decay.py',
    './_base_/backbones.py',
]
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone={{_base_.setformer_t_ade20k_backbone}},
    decode_head=dict(in_channels=[64, 128, 256, 512]),
    auxiliary_head=dict(in_channels=256))
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg={{_base_.setformer_no_decay}})
