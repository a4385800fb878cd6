"""Inference kernel of the transformer block's second half, ``x + fc2(act(fc1(norm(x))))``.

The plain form makes four fresh ``(B·N, ·)`` tensors (the norm output, the ``fc1`` output of
width ``r·C``, the activation of the same width and the ``fc2`` output) and the residual sum, each
written once to memory and read back. At a stage-1 resolution these are tens of MB (8 × 3136
tokens × 512 hidden channels × 4 bytes = 51 MB), larger than the caches, and a fresh buffer of that
size is page-faulted on first touch by glibc's allocator. Here the rows are taken ``rows`` tokens at
a time: norm, ``fc1``, the activation *in place*, ``fc2`` into a small buffer, and the residual added
into ``x`` in place. The hidden activations of one chunk (1024 rows: 1.5-12 MB for hidden widths
384-3072) stay in the caches and the buffers are reused from chunk to chunk. On other devices
(CUDA) the whole tensor is one chunk: the in-place activation and residual still save two
buffers, and small kernels would cost launches. Every row goes through the same operations in the same
order as in the plain form (the norm and the GEMM rows are independent of each other), so the
result equals the plain form up to the GEMM library's blocking (bit-equal in the measurements).

Forward only, in place on ``x``: the caller owns ``x`` and needs no gradient.
"""
import torch
import torch.nn.functional as F

from .common import linear_into

__all__ = ['ffn_residual_', 'CPU_CHUNK_ROWS']

#: tokens per chunk on CPU (measured, one thread, fp32, hidden 384-3072: 512-2048 rows are
#: equally fast, 256 and whole-tensor chunks slower)
CPU_CHUNK_ROWS = 1024


def ffn_residual_(x, norm_weight, norm_bias, eps, w1, b1, w2, b2, approximate='none', rows=None):
    """In place: ``x += fc2(gelu(fc1(layer_norm(x))))``, ``rows`` tokens at a time.

    Args:
        x (Tensor): (..., C), contiguous; overwritten with the result, which is also returned.
        norm_weight, norm_bias (Tensor | None): the LayerNorm's affine parameters (C, ).
        eps (float): the LayerNorm's epsilon.
        w1, b1 (Tensor): ``fc1`` weight (hidden, C) and bias (hidden, ) or None.
        w2, b2 (Tensor): ``fc2`` weight (C, hidden) and bias (C, ) or None.
        approximate (str): the GELU's ``approximate`` (``'none'`` or ``'tanh'``).
        rows (int, optional): tokens per chunk; default :data:`CPU_CHUNK_ROWS` on CPU, all of
            them elsewhere.
    """
    C = x.shape[-1]
    hidden = w1.shape[0]
    if not x.is_contiguous():
        raise ValueError('ffn_residual_: x must be contiguous (it is updated in place)')
    if w1.shape != (hidden, C) or w2.shape != (C, hidden):
        raise ValueError(f'ffn_residual_: fc1 {tuple(w1.shape)} and fc2 {tuple(w2.shape)} do not '
                         f'match {C} input channels')
    xf = x.view(-1, C)
    if rows is None:
        rows = CPU_CHUNK_ROWS if x.device.type == 'cpu' else max(xf.shape[0], 1)
    if rows < 1:
        raise ValueError(f'ffn_residual_: rows must be positive, got {rows}')
    h_buf = y_buf = None
    for s in range(0, xf.shape[0], rows):
        xs = xf[s:s + rows]
        m = xs.shape[0]
        if h_buf is None or h_buf.shape[0] != m:
            h_buf = xs.new_empty(m, hidden)
            y_buf = xs.new_empty(m, C)
        n = F.layer_norm(xs, (C, ), norm_weight, norm_bias, eps)
        linear_into(n, w1, b1, h_buf)
        torch.ops.aten.gelu_(h_buf, approximate=approximate)
        xs.add_(linear_into(h_buf, w2, b2, y_buf))
    return x
