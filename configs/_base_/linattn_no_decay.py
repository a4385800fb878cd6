# No weight decay on normalisation layers and position tables (Swin / PVT / DeiT detection and
# segmentation recipes). Used as ``paramwise_cfg={{_base_.linattn_no_decay}}``.
linattn_no_decay = dict(
    custom_keys={
        'norm': dict(decay_mult=0.),
        'absolute_pos_embed': dict(decay_mult=0.),
        'relative_position_bias_table': dict(decay_mult=0.),
        'pos_embed': dict(decay_mult=0.),
        'cls_token': dict(decay_mult=0.),
    })
