from .base import LinAttnBackbone
from .pvt import LinAttnPVT, LinAttnPVTv2
from .swin import LinAttnSwin
from .vit import LinAttnViT
from . import nalaformer  # noqa: F401,E402  (native NaLaFormer hierarchy)
from . import resnet_polynl  # noqa: F401,E402  (ResNet-50 + Poly-NL)
from . import setformer  # noqa: F401,E402  (NAT-style SeTformer hierarchy)

__all__ = ['LinAttnBackbone', 'LinAttnPVT', 'LinAttnPVTv2', 'LinAttnSwin', 'LinAttnViT']
