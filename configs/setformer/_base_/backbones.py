# Backbones of the detection / segmentation configs in this folder, one `<name>_backbone` each
# (used as `backbone={{_base_.<name>_backbone}}`), and the optimizer's no-decay keys. Point a config
# at another checkpoint with --cfg-options model.backbone.init_cfg.checkpoint=FILE.
# SeT settings are the paper's (Experiments section, Tables 8 and 15): COCO m=750, eps=0.3,
# tau=0.8; ADE20K m=800, eps=0.3, tau=0.8 (ImageNet: m=500, eps=0.1, tau=0.5). The ImageNet
# checkpoint has m=500 references per block: on loading, they are adapted to 750 / 800 (source
# references plus perturbed copies, reported in the load report; see resize_refs).
_base_ = ['../../_base_/safe_checkpoints.py']  # runner checkpoints load with the stock tools too

# ImageNet-1k SeTformer-T weights. There are no public ones (no official code): train
# configs/setformer/setformer-t_in1k.py and put the file here.
setformer_t_pretrained = 'checkpoints/setformer_t.pth'
# M / S / B (the dense configs of those sizes take the T backbones with their arch and these)
setformer_m_pretrained = 'checkpoints/setformer_m.pth'
setformer_s_pretrained = 'checkpoints/setformer_s.pth'
setformer_b_pretrained = 'checkpoints/setformer_b.pth'

setformer_t_coco_backbone = dict(
    _delete_=True,
    type='SeTformer',
    arch='t',
    attn_cfg=dict(type='SeTAttention', num_refs=750, eps=0.3, tau=0.8),
    drop_path_rate=0.2,  # not stated in the paper; the ImageNet (NAT-T) value
    out_indices=(0, 1, 2, 3),
    init_cfg=dict(type='Pretrained', checkpoint=setformer_t_pretrained)
)

setformer_t_ade20k_backbone = dict(
    _delete_=True,
    type='SeTformer',
    arch='t',
    attn_cfg=dict(type='SeTAttention', num_refs=800, eps=0.3, tau=0.8),
    drop_path_rate=0.2,  # not stated in the paper; the ImageNet (NAT-T) value
    out_indices=(0, 1, 2, 3),
    init_cfg=dict(type='Pretrained', checkpoint=setformer_t_pretrained)
)

# No weight decay on normalisation layers (the `norm` key of ../_base_/linattn_no_decay.py, the
# only one of its keys that exists in SeTformer) nor on the SeT references / Nystrom anchors: the
# kernel normalises them, so decaying their norm would only raise their effective learning rate.
setformer_no_decay = dict(
    custom_keys={
        'norm': dict(decay_mult=0.),
        'refs': dict(decay_mult=0.),
        'anchors': dict(decay_mult=0.),
    })
