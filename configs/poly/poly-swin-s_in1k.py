# Poly-Swin-S ImageNet-1k classifier (same recipe as poly-swin-t; not in the paper).
_base_ = ['./poly-swin-t_in1k.py']
model = dict(backbone=dict(arch='s', drop_path_rate=0.3))
