# Pola-Swin-S ImageNet-1k classifier (same recipe as pola-swin-t). 50.60M params, 83.6 top-1 (paper).
_base_ = ['./pola-swin-t_in1k.py']
model = dict(backbone=dict(arch='s', drop_path_rate=0.3), head=dict(in_channels=768))
