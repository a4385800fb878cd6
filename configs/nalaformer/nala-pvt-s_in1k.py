# NaLa-PVT-S ImageNet-1k classifier (same recipe as nala-pvt-t_in1k).
_base_ = ['./nala-pvt-t_in1k.py']
model = dict(backbone=dict(arch='s'))
