"""Attention kernels, separate from the modules (like flash-linear-attention's ``ops``): the pure
torch kernels (differentiable, any device) and the Triton kernels for CUDA inference (their modules,
and Triton with them, are imported on first use)."""
from .nala import nala_attention_fast
from .pola import polarity_attention_fast, polarity_features

__all__ = ['nala_attention_fast', 'polarity_attention_fast', 'polarity_features',
           'polarity_attention_triton', 'nala_attention_triton', 'triton_available']


def __getattr__(name):
    if name in ('polarity_attention_triton', 'triton_available'):
        from . import pola_triton
        return getattr(pola_triton, name)
    if name == 'nala_attention_triton':
        from . import nala_triton
        return nala_triton.nala_attention_triton
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
