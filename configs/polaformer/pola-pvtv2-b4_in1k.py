# Pola-PVTv2-b4 ImageNet-1k classifier (same design and recipe as pola-pvtv2-b0). No result reported.
_base_ = ['./pola-pvtv2-b0_in1k.py']
model = dict(backbone=dict(arch='b4', drop_path_rate=0.3), head=dict(in_channels=512))
