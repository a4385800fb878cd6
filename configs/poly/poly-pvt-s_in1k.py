# Poly-PVT-S ImageNet-1k classifier (same recipe as poly-pvt-t; not in the paper).
_base_ = ['./poly-pvt-t_in1k.py']
model = dict(backbone=dict(arch='s'))
