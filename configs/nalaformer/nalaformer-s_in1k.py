# NaLaFormer-S ImageNet-1k classifier (same paper recipe as nalaformer-t_in1k; drop path 0.15).
_base_ = ['./nalaformer-t_in1k.py']
model = dict(backbone=dict(arch='s', drop_path_rate=0.15))
