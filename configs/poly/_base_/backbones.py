# Backbones of the detection / segmentation configs in this folder, one `<name>_backbone` each
# (used as `backbone={{_base_.<name>_backbone}}`). Point a config at another checkpoint with
# --cfg-options model.backbone.init_cfg.checkpoint=FILE.
_base_ = ['../../_base_/safe_checkpoints.py']  # runner checkpoints load with the stock tools too

# ResNet-50 + one Poly-NL block (reduction 4) right before the last residual block of res4, the
# paper's COCO network (§5.1.3). The ResNet weights are the stock ImageNet ones (torchvision
# names); the Poly-NL block starts as the identity (beta = 0). For an ImageNet-trained Poly-NL block
# use the checkpoint of resnet50-polynl_8xb32_in1k.py instead (same key names).
# pad_mask='infer': the block averages over the valid (non-padded) region of every image.
r50_polynl_pretrained = 'torchvision://resnet50'
r50_polynl_backbone = dict(
    _delete_=True,
    type='PolyNLResNet',
    depth=50,
    polynl_cfg=dict(reduction=4),
    polynl_positions=[(2, -1)],
    pad_mask='infer',
    out_indices=(0, 1, 2, 3),
    frozen_stages=1,
    norm_cfg=dict(type='BN', requires_grad=True),
    norm_eval=True,
    style='pytorch',
    init_cfg=dict(type='Pretrained', checkpoint=r50_polynl_pretrained))

# Poly-SA in the Swin-T skeleton: pooling inside 7x7 windows (shifted in odd blocks, pooled per
# shift region), 3x3 depth-wise projection, LayerNorm sigma (paper Table 3: 26.1M, 80.66 top-1).
poly_swin_t_pretrained = 'checkpoints/poly_swin-t.pth'  # from configs/poly/poly-swin-t_in1k.py (no released Poly-SA weights): put the file here
poly_swin_t_backbone = dict(
    _delete_=True,
    type='LinAttnSwin',
    arch='t',
    attn_cfg=dict(type='PolySelfAttention', window_size=7),
    drop_path_rate=0.2,
    out_indices=(0, 1, 2, 3),
    init_cfg=dict(type='Pretrained', checkpoint=poly_swin_t_pretrained))

# Poly-SA in the PVT-T skeleton (not in the paper): K/V on PVT's spatially reduced grid, p2 sized
# to it and p1 to the full grid, both resized to the input.
poly_pvt_t_pretrained = 'checkpoints/poly_pvt-t.pth'  # from configs/poly/poly-pvt-t_in1k.py (no released Poly-SA weights): put the file here
poly_pvt_t_backbone = dict(
    _delete_=True,
    type='LinAttnPVT',
    arch='t',
    attn_cfg=dict(type='PolySelfAttention'),
    drop_path_rate=0.1,
    out_indices=(0, 1, 2, 3),
    init_cfg=dict(type='Pretrained', checkpoint=poly_pvt_t_pretrained))
