# Pola-Swin-B ImageNet-1k classifier (same recipe as pola-swin-t; the official run used batch 64 per
# GPU). 89.14M params, 83.8 top-1 (paper).
_base_ = ['./pola-swin-t_in1k.py']
model = dict(backbone=dict(arch='b', drop_path_rate=0.5), head=dict(in_channels=1024))
