# deit-s ImageNet-1k classifier (same recipe as deit-t).
_base_ = ['./deit-t_in1k.py']
model = dict(backbone=dict(arch='s', drop_path_rate=0.1), head=dict(in_channels=384))
