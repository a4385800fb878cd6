# Poly-DeiT-S ImageNet-1k classifier (same recipe as poly-deit-t; not in the paper).
_base_ = ['./poly-deit-t_in1k.py']
model = dict(backbone=dict(arch='s'), head=dict(in_channels=384))
