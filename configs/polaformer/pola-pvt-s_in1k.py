# Pola-PVT-S ImageNet-1k classifier (same recipe as pola-pvt-t). 23.16M params, 81.9 top-1 (paper).
_base_ = ['./pola-pvt-t_in1k.py']
model = dict(backbone=dict(arch='s', drop_path_rate=0.1), head=dict(in_channels=512))
