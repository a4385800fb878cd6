# NaLaFormer-B ImageNet-1k classifier (same paper recipe as nalaformer-t_in1k; drop path 0.4).
_base_ = ['./nalaformer-t_in1k.py']
model = dict(backbone=dict(arch='b', drop_path_rate=0.4))
