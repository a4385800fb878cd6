# Pola-PVT-M ImageNet-1k classifier (same recipe as pola-pvt-t; official cfg pola_pvt_m: drop path
# 0.3, gradient clipping 1.0). 39.97M params; no result reported.
_base_ = ['./pola-pvt-t_in1k.py']
model = dict(backbone=dict(arch='m', drop_path_rate=0.3), head=dict(in_channels=512))
optim_wrapper = dict(clip_grad=dict(max_norm=1.0))
