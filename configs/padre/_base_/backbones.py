# Backbones of the detection / segmentation configs in this folder, one `<name>_backbone`
# each (used as `backbone={{_base_.<name>_backbone}}`). Point a config at another checkpoint with
# --cfg-options model.backbone.init_cfg.checkpoint=FILE.
# PADRe-Swin-T / PADRe-PVT-T are plugin designs (the paper has no hierarchical backbone): degree-2
# PADRe mixers in every stage (a list of 4 configs chooses per stage); any input size works (no
# windows, no size-dependent tensors).
_base_ = ['../../_base_/safe_checkpoints.py']  # runner checkpoints load with the stock tools too

padre_pvt_t_pretrained = 'checkpoints/padre_pvt-t.pth'  # ImageNet-1k weights from configs/padre/padre-pvt-t_in1k.py (no released PADRe weights): put the file here
padre_pvt_t_backbone = dict(
    _delete_=True,
    type='LinAttnPVT',
    arch='t',
    attn_cfg=dict(type='PADReMixer', degree=2, kernel_size=11),
    drop_path_rate=0.1,
    out_indices=(0, 1, 2, 3),
    init_cfg=dict(type='Pretrained', checkpoint=padre_pvt_t_pretrained)
)

padre_swin_t_pretrained = 'checkpoints/padre_swin-t.pth'  # ImageNet-1k weights from configs/padre/padre-swin-t_in1k.py (no released PADRe weights): put the file here
padre_swin_t_backbone = dict(
    _delete_=True,
    type='LinAttnSwin',
    arch='t',
    attn_cfg=dict(type='PADReMixer', degree=2, kernel_size=11),
    drop_path_rate=0.2,
    out_indices=(0, 1, 2, 3),
    init_cfg=dict(type='Pretrained', checkpoint=padre_swin_t_pretrained)
)
