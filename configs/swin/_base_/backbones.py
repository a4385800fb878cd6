# Backbones of the detection / segmentation configs in this folder, one `<name>_backbone`
# each (used as `backbone={{_base_.<name>_backbone}}`). Point a config at another checkpoint with
# --cfg-options model.backbone.init_cfg.checkpoint=FILE.
_base_ = ['../../_base_/safe_checkpoints.py']  # runner checkpoints load with the stock tools too

swin_t_pretrained = 'https://github.com/SwinTransformer/storage/releases/download/v1.0.0/swin_tiny_patch4_window7_224.pth'  # official ImageNet-1k weights
swin_t_backbone = dict(
    _delete_=True,
    type='LinAttnSwin',
    arch='t',
    drop_path_rate=0.2,
    out_indices=(0, 1, 2, 3),
    init_cfg=dict(type='Pretrained', checkpoint=swin_t_pretrained)
)
