# NaLaFormer-T ImageNet-1k classifier, paper recipe (App. A.2 + the official DeiT-based code):
# AdamW lr 1e-3 at batch 1024 (16 x 64), wd 0.05, 320 epochs with 20 linear warm-up epochs, cosine
# to 1e-5, RandAugment m9-mstd0.5, mixup 0.8 / cutmix 1.0, label smoothing 0.1, random erasing
# 0.25, repeated augmentation, EMA (decay 0.99996), no gradient clipping.
# The backbone holds the official classifier (proj 1024 -> BN -> SiLU -> pool -> 1x1 conv head) and
# returns logits (mmpretrain ClsHead), so official files ({'model', 'model_ema'}) load unchanged:
#     linattn_mm.get_model('nalaformer-t_in1k', pretrained='nalaformer_t.pth')
_base_ = ['mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='NaLaFormer',
        arch='t',
        drop_path_rate=0.1,
        out_indices=(),
        num_classes=1000),
    neck=None,
    head=dict(
        _delete_=True,
        type='ClsHead',
        loss=dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original'),
        cal_acc=False),
    init_cfg=None)
train_dataloader = dict(sampler=dict(type='RepeatAugSampler', shuffle=True))
optim_wrapper = dict(clip_grad=None)
train_cfg = dict(max_epochs=320)
custom_hooks = [dict(type='EMAHook', momentum=4e-5, priority='ABOVE_NORMAL'),
                dict(type='linattn_mm.SafeGlobalsHook')]  # see ../_base_/safe_checkpoints.py
