# Backbones of the detection / segmentation configs in this folder, one `<name>_backbone`
# each (used as `backbone={{_base_.<name>_backbone}}`). Point a config at another checkpoint with
# --cfg-options model.backbone.init_cfg.checkpoint=FILE.
_base_ = ['../../_base_/safe_checkpoints.py']  # runner checkpoints load with the stock tools too

pvtv2_b0_pretrained = 'https://github.com/whai362/PVT/releases/download/v2/pvt_v2_b0.pth'  # official ImageNet-1k weights
pvtv2_b0_backbone = dict(
    _delete_=True,
    type='LinAttnPVTv2',
    arch='b0',
    drop_path_rate=0.1,
    out_indices=(0, 1, 2, 3),
    init_cfg=dict(type='Pretrained', checkpoint=pvtv2_b0_pretrained)
)
