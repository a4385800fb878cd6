"""The blocks' FFN halves: inference kernels (:mod:`.inference`: chunked, in place; used by the
inference forms of :mod:`linattn_mm.deploy`) and training Functions (:mod:`.autograd`: lean
backward, used by the blocks' default forward; :mod:`.fused`: NaLaFormer's conv sums as Triton
kernels, a block's ``ffn_core='fused'``; imported on first use, as Triton is)."""
from .autograd import ConvFFNBranch, FFNBranch, conv_ffn_branch, ffn_branch
from .inference import (CPU_BAND_TOKENS, CPU_CHUNK_ROWS, channels_last_map, conv_ffn_residual_,
                        ffn_residual_)

__all__ = ['FFNBranch', 'ConvFFNBranch', 'ffn_branch', 'conv_ffn_branch', 'ffn_residual_',
           'conv_ffn_residual_', 'channels_last_map', 'CPU_CHUNK_ROWS', 'CPU_BAND_TOKENS']
