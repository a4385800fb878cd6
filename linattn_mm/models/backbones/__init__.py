from .base import LinAttnBackbone
from .pvt import LinAttnPVT, LinAttnPVTv2
from .swin import LinAttnSwin
from .vit import LinAttnViT

__all__ = ['LinAttnBackbone', 'LinAttnPVT', 'LinAttnPVTv2', 'LinAttnSwin', 'LinAttnViT']
