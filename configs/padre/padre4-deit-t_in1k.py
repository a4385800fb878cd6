# PADRe-4 DeiT-T ImageNet-1k classifier: DeiT-T with every softmax attention replaced by
# a degree-4 PADRe mixer (single head, depth-wise 11x11 token convs, 1x1 channel mixing, no
# degree-1 term). The class token is kept (out_type='cls_token'; it is mixed with the grid mean,
# PADReMixer cls_mode='pool', a plugin choice: the paper does not say) and DeiT's absolute position
# embedding is kept. Recipe: the stock DeiT 300-epoch one without distillation (paper §4.2).
# Paper, Table 5 (degree ablation): 76.9 top-1. No released weights.
_base_ = ['mmpretrain::deit/deit-tiny_4xb256_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnViT',
        arch='t',
        attn_cfg=dict(type='PADReMixer', degree=4, kernel_size=11),
        drop_path_rate=0.1,
        out_type='cls_token',
    ),
    head=dict(in_channels=192))
