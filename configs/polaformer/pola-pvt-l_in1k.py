# Pola-PVT-L ImageNet-1k classifier (same recipe as pola-pvt-t; official cfg pola_pvt_b: drop path
# 0.3, gradient clipping 1.0). 54.37M params; no result reported.
_base_ = ['./pola-pvt-t_in1k.py']
model = dict(backbone=dict(arch='l', drop_path_rate=0.3), head=dict(in_channels=512))
optim_wrapper = dict(clip_grad=dict(max_norm=1.0))
