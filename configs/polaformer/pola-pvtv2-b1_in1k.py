# Pola-PVTv2-b1 ImageNet-1k classifier (same design and recipe as pola-pvtv2-b0). 12.93M params, 80.2 top-1 (paper).
_base_ = ['./pola-pvtv2-b0_in1k.py']
model = dict(backbone=dict(arch='b1', drop_path_rate=0.1), head=dict(in_channels=512))
