# Backbones of the detection / segmentation configs in this folder, one `<name>_backbone`
# each (used as `backbone={{_base_.<name>_backbone}}`). Point a config at another checkpoint with
# --cfg-options model.backbone.init_cfg.checkpoint=FILE.
_base_ = ['../../_base_/safe_checkpoints.py']  # runner checkpoints load with the stock tools too

pvt_t_pretrained = 'https://github.com/whai362/PVT/releases/download/v2/pvt_tiny.pth'  # official ImageNet-1k weights
pvt_t_backbone = dict(
    _delete_=True,
    type='LinAttnPVT',
    arch='t',
    drop_path_rate=0.1,
    out_indices=(0, 1, 2, 3),
    init_cfg=dict(type='Pretrained', checkpoint=pvt_t_pretrained)
)
