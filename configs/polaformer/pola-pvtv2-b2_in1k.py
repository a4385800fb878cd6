# Pola-PVTv2-b2 ImageNet-1k classifier (same design and recipe as pola-pvtv2-b0). No result reported.
_base_ = ['./pola-pvtv2-b0_in1k.py']
model = dict(backbone=dict(arch='b2', drop_path_rate=0.1), head=dict(in_channels=512))
