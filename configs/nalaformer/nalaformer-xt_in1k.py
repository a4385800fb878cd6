# NaLaFormer-XT ImageNet-1k classifier (same paper recipe as nalaformer-t_in1k; drop path 0.1). XT
# is in the official code and README (8M / 1.0G / 79.1 there), not in the paper's tables; the
# official widths count 6.14M / 0.64 GMACs (see docs/model_zoo/nalaformer.md).
_base_ = ['./nalaformer-t_in1k.py']
model = dict(backbone=dict(arch='xt'))  # drop path 0.1, as T
