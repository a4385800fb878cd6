# pvtv2-b1 ImageNet-1k classifier (same recipe as pvtv2-b0).
_base_ = ['./pvtv2-b0_in1k.py']
model = dict(backbone=dict(arch='b1', drop_path_rate=0.1), head=dict(in_channels=512))
