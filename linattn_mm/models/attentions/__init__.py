from .base import BaseTokenMixer, build_attention, list_attentions
from .softmax import GlobalSoftmaxAttention, SRSoftmaxAttention, WindowSoftmaxAttention

__all__ = ['BaseTokenMixer', 'build_attention', 'list_attentions', 'GlobalSoftmaxAttention',
           'SRSoftmaxAttention', 'WindowSoftmaxAttention']
