# pvt-s ImageNet-1k classifier (same recipe as pvt-t).
_base_ = ['./pvt-t_in1k.py']
model = dict(backbone=dict(arch='s', drop_path_rate=0.1), head=dict(in_channels=512))
