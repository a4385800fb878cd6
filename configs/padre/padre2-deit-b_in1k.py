# PADRe-2 DeiT-B ImageNet-1k classifier: DeiT-B with every softmax attention replaced by
# a degree-2 PADRe mixer (single head, depth-wise 11x11 token convs, 1x1 channel mixing, no
# degree-1 term). The class token is kept (out_type='cls_token'; it is mixed with the grid mean,
# PADReMixer cls_mode='pool', a plugin choice: the paper does not say) and DeiT's absolute position
# embedding is kept. Recipe: the stock DeiT 300-epoch one without distillation (paper §4.2).
# Paper, Table 2: 81.4 top-1, 18.8 GFLOPs, 80M params. No released weights.
_base_ = ['mmpretrain::deit/deit-base_16xb64_in1k.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnViT',
        arch='b',
        attn_cfg=dict(type='PADReMixer', degree=2, kernel_size=11),
        drop_path_rate=0.1,
        out_type='cls_token',
    ),
    head=dict(in_channels=768))
# the stock EMA hook, and the allow-list of ../_base_/safe_checkpoints.py (a second base cannot
# set custom_hooks next to the stock file's)
custom_hooks = [dict(type='EMAHook', momentum=4e-5, priority='ABOVE_NORMAL'),
                dict(type='linattn_mm.SafeGlobalsHook')]
