from .base import BaseTokenMixer, build_attention, list_attentions
from .softmax import GlobalSoftmaxAttention, SRSoftmaxAttention, WindowSoftmaxAttention
from . import nala, pola  # noqa: F401,E402  (linear families register themselves)
from . import padre  # noqa: F401,E402
from . import poly  # noqa: F401,E402
from . import setformer  # noqa: F401,E402

__all__ = ['BaseTokenMixer', 'build_attention', 'list_attentions', 'GlobalSoftmaxAttention',
           'SRSoftmaxAttention', 'WindowSoftmaxAttention']
