# SeTformer-M ("Miny" in the paper) ImageNet-1k classifier: same recipe as setformer-t_in1k,
# depths 3/4/6/5 (NAT-Mini widths: C=64, heads 2/4/8/16, MLP ratio 3, drop path 0.2).
# Paper: 16.2M params, 2.8G FLOPs, 81.7 top-1. This model: 18.79M parameters (16.39M without the
# 2.40M learnable references).
_base_ = ['./setformer-t_in1k.py']
model = dict(backbone=dict(arch='m', drop_path_rate=0.2), head=dict(in_channels=512))
