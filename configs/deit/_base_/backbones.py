# Backbones of the detection / segmentation configs in this folder, one `<name>_backbone`
# each (used as `backbone={{_base_.<name>_backbone}}`). Point a config at another checkpoint with
# --cfg-options model.backbone.init_cfg.checkpoint=FILE.
_base_ = ['../../_base_/safe_checkpoints.py']  # runner checkpoints load with the stock tools too

deit_t_pretrained = 'https://dl.fbaipublicfiles.com/deit/deit_tiny_patch16_224-a1311bcf.pth'  # official ImageNet-1k weights
deit_t_backbone = dict(
    _delete_=True,
    type='LinAttnViT',
    arch='t',
    drop_path_rate=0.1,
    out_indices=(2, 5, 8, 11),  # block indices: the last block of each quarter
    init_cfg=dict(type='Pretrained', checkpoint=deit_t_pretrained)
)
