"""Attention kernels, separate from the modules (like flash-linear-attention's ``ops``): pure torch,
differentiable, device-agnostic."""
from .pola import polarity_attention_fast, polarity_features

__all__ = ['polarity_attention_fast', 'polarity_features']
