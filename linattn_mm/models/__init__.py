"""Model code: token mixers (``attentions``) and skeletons (``backbones``). Depends on torch and
mmengine only (no compiled mmcv ops)."""
from . import attentions, backbones  # noqa: F401
from .attentions import build_attention, list_attentions  # noqa: F401
