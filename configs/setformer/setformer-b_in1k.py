# SeTformer-B ImageNet-1k classifier: same recipe as setformer-t_in1k, depths 3/4/18/5 with NAT-B
# widths (C=128, heads 4/8/16/32, MLP ratio 2, drop path 0.5, layer scale 1e-5; paper silent).
# Paper: 56.7M params, 10.2G FLOPs, 86.2 top-1. This model: 76.98M parameters (69.11M without the
# 7.87M references): the paper's S/B counts are not reproducible with NAT widths
# (docs/model_zoo/setformer.md).
_base_ = ['./setformer-t_in1k.py']
model = dict(backbone=dict(arch='b', drop_path_rate=0.5), head=dict(in_channels=1024))
