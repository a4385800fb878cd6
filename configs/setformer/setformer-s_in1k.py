# SeTformer-S ImageNet-1k classifier: same recipe as setformer-t_in1k, depths 3/4/18/5 with NAT-S
# widths (C=96, heads 3/6/12/24, MLP ratio 2, drop path 0.3, layer scale 1e-5; paper silent).
# Paper: 35.0M params, 6.9G FLOPs, 84.7 top-1. This model: 45.00M parameters (39.10M without the
# 5.90M references): the paper's S/B counts are not reproducible with NAT widths
# (docs/model_zoo/setformer.md).
_base_ = ['./setformer-t_in1k.py']
model = dict(backbone=dict(arch='s', drop_path_rate=0.3), head=dict(in_channels=768))
