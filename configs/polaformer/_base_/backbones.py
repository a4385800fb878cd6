# Backbones of the detection / segmentation configs in this folder, one `<name>_backbone`
# each (used as `backbone={{_base_.<name>_backbone}}`). Point a config at another checkpoint with
# --cfg-options model.backbone.init_cfg.checkpoint=FILE.
_base_ = ['../../_base_/safe_checkpoints.py']  # runner checkpoints load with the stock tools too

pola_pvt_s_pretrained = 'checkpoints/pola_pvt_s.pth'  # official ImageNet-1k Pola weights (HuggingFace ZachMeng/PolaFormer; no URL verified): put the file here
pola_pvt_s_backbone = dict(
    _delete_=True,
    type='LinAttnPVT',
    arch='s',
    attn_cfg=dict(type='PolaLinearAttention', qkv_layout='qg_kv', la_sr_ratio=1),
    drop_path_rate=0.1,
    out_indices=(0, 1, 2, 3),
    init_cfg=dict(type='Pretrained', checkpoint=pola_pvt_s_pretrained)
)

pola_pvt_t_pretrained = 'checkpoints/pola_pvt_t.pth'  # official ImageNet-1k Pola weights (HuggingFace ZachMeng/PolaFormer; no URL verified): put the file here
pola_pvt_t_backbone = dict(
    _delete_=True,
    type='LinAttnPVT',
    arch='t',
    attn_cfg=dict(type='PolaLinearAttention', qkv_layout='qg_kv', la_sr_ratio=1),
    drop_path_rate=0.1,
    out_indices=(0, 1, 2, 3),
    init_cfg=dict(type='Pretrained', checkpoint=pola_pvt_t_pretrained)
)

pola_swin_t_pretrained = 'checkpoints/pola_swin_t.pth'  # official ImageNet-1k Pola weights (HuggingFace ZachMeng/PolaFormer; no URL verified): put the file here
# Stages 1-2: global Pola attention on the whole map (the official window 56 is the whole map at
# 224; at 1333x800 the stage-1 map is ~200x334, O(N d^2)); position encodings resized to the input.
# Stages 3-4: Swin window-7 (shifted) softmax attention.
pola_swin_t_pola_attn = dict(type='PolaLinearAttention', qkv_layout='qkvg', alpha=4, kernel_size=5)
pola_swin_t_backbone = dict(
    _delete_=True,
    type='LinAttnSwin',
    arch='t',
    attn_cfg=[
        pola_swin_t_pola_attn, pola_swin_t_pola_attn,
        dict(type='WindowSoftmaxAttention', window_size=7),
        dict(type='WindowSoftmaxAttention', window_size=7),
    ],
    drop_path_rate=0.2,
    out_indices=(0, 1, 2, 3),
    init_cfg=dict(type='Pretrained', checkpoint=pola_swin_t_pretrained)
)
