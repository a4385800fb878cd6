# swin-b ImageNet-1k classifier (same recipe as swin-t).
_base_ = ['./swin-t_in1k.py']
model = dict(backbone=dict(arch='b', drop_path_rate=0.5), head=dict(in_channels=1024))
