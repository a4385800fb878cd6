# pvt-l ImageNet-1k classifier (same recipe as pvt-t).
_base_ = ['./pvt-t_in1k.py']
model = dict(backbone=dict(arch='l', drop_path_rate=0.3), head=dict(in_channels=512))
