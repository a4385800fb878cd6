# Backbones of the detection / segmentation configs in this folder, one `<name>_backbone`
# each (used as `backbone={{_base_.<name>_backbone}}`). Point a config at another checkpoint with
# --cfg-options model.backbone.init_cfg.checkpoint=FILE.
_base_ = ['../../_base_/safe_checkpoints.py']  # runner checkpoints load with the stock tools too

# ImageNet-1k NaLaFormer-S weights. There are no public ones: train nalaformer-s_in1k (or
# place an official-format file, {'model': ..., 'model_ema': ...}, here; EMA weights are preferred).
nalaformer_s_pretrained = 'checkpoints/nalaformer_s.pth'
nalaformer_s_backbone = dict(
    _delete_=True,
    type='NaLaFormer',
    arch='s',
    drop_path_rate=0.15,  # not stated in the paper; the ImageNet value
    out_indices=(0, 1, 2, 3),
    norm_eval=True,  # BatchNorm of the stem / patch merging frozen (2 images per GPU)
    init_cfg=dict(type='Pretrained', checkpoint=nalaformer_s_pretrained)
)

# ImageNet-1k NaLaFormer-T weights. There are no public ones: train nalaformer-t_in1k (or
# place an official-format file, {'model': ..., 'model_ema': ...}, here; EMA weights are preferred).
nalaformer_t_pretrained = 'checkpoints/nalaformer_t.pth'
nalaformer_t_backbone = dict(
    _delete_=True,
    type='NaLaFormer',
    arch='t',
    drop_path_rate=0.1,  # not stated in the paper; the ImageNet value
    out_indices=(0, 1, 2, 3),
    norm_eval=True,  # BatchNorm of the stem / patch merging frozen (2 images per GPU)
    init_cfg=dict(type='Pretrained', checkpoint=nalaformer_t_pretrained)
)

# ImageNet-1k NaLaFormer-XT weights (the XT configs take the T backbone with arch='xt'). There are
# no public ones: train nalaformer-xt_in1k (or place an official-format file here).
nalaformer_xt_pretrained = 'checkpoints/nalaformer_xt.pth'
