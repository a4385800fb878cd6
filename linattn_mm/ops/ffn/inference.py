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

from ..common import linear_into

__all__ = ['ffn_residual_', 'conv_ffn_residual_', 'channels_last_map', 'CPU_CHUNK_ROWS',
           'CPU_BAND_TOKENS']

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


#: tokens per row band of :func:`conv_ffn_residual_` on CPU (at least one row per band)
CPU_BAND_TOKENS = 2048


def channels_last_map(x):
    """Whether the (B, C, H, W) map ``x`` is a contiguous (B, H, W, C) buffer viewed as NCHW,
    the batch stride included (what :func:`conv_ffn_residual_` updates in place)."""
    return x.is_contiguous(memory_format=torch.channels_last) and x.stride(0) == x[0].numel()


def _hidden_rows_(x_rows, norm_weight, norm_bias, eps, w1, b1, approximate, out):
    """``gelu(fc1(layer_norm(x_rows)))`` of whole image rows (r, W, C) into ``out`` (r, W, hidden),
    the activation in place."""
    C = x_rows.shape[-1]
    n = F.layer_norm(x_rows.reshape(-1, C), (C, ), norm_weight, norm_bias, eps)
    linear_into(n, w1, b1, out.view(n.shape[0], -1))
    return torch.ops.aten.gelu_(out, approximate=approximate)


def conv_ffn_residual_(x, norm_weight, norm_bias, eps, w1, b1, dw_weight, dw_bias, w2, b2,
                       scale=None, approximate='none', rows=None):
    """In place on a channels-last map: ``x += scale * fc2(h + dwconv(h))`` with
    ``h = gelu(fc1(layer_norm(x)))`` over the channels (NaLaFormer's ConvFFN half of a block),
    ``rows`` image rows at a time.

    The plain form makes four maps of the hidden width (``fc1``, ``gelu``, the conv, the sum), each
    ``r`` times the size of ``x``. Here each band of rows keeps its hidden rows in one buffer with
    a row above and below (the conv's reach). The rows shared by neighbouring bands are carried
    over, not recomputed, so every hidden row is computed once and from ``x`` before that row's
    update; the image's top and bottom borders are zero rows, the left and right ones the conv's
    padding.

    Args:
        x (Tensor): (B, C, H, W) with channels-last memory (a contiguous (B, H, W, C) buffer
            viewed as NCHW); updated in place and returned.
        norm_weight, norm_bias (Tensor | None), eps (float): the LayerNorm over C.
        w1, b1 (Tensor): ``fc1`` (hidden, C), (hidden, ) or None.
        dw_weight, dw_bias (Tensor): the depth-wise 3 x 3 conv (hidden, 1, 3, 3), (hidden, ) or
            None (stride 1, padding 1).
        w2, b2 (Tensor): ``fc2`` (C, hidden), (C, ) or None.
        scale (Tensor, optional): the layer scale (C, ) applied to the branch before the sum.
        approximate (str): the GELU's ``approximate``.
        rows (int, optional): image rows per band; default :data:`CPU_BAND_TOKENS` tokens' worth
            (at least one row).
    """
    B, C, H, W = x.shape
    hidden = w1.shape[0]
    if not channels_last_map(x):
        raise ValueError('conv_ffn_residual_: x must be a channels-last (B, H, W, C) buffer viewed '
                         'as (B, C, H, W) (it is updated in place)')
    if w1.shape != (hidden, C) or w2.shape != (C, hidden) or dw_weight.shape != (hidden, 1, 3, 3):
        raise ValueError(f'conv_ffn_residual_: fc1 {tuple(w1.shape)}, dwconv '
                         f'{tuple(dw_weight.shape)} and fc2 {tuple(w2.shape)} do not make a '
                         f'{C}-channel ConvFFN with a depth-wise 3 x 3 conv')
    R = max(CPU_BAND_TOKENS // max(W, 1), 1) if rows is None else rows
    if R < 1:
        raise ValueError(f'conv_ffn_residual_: rows must be positive, got {R}')
    R = min(R, H)
    xr = x.permute(0, 2, 3, 1)  # (B, H, W, C), contiguous
    hbuf = x.new_empty(R + 2, W, hidden)  # hidden rows r0 - 1 .. r0 + R
    y = x.new_empty(R * W, C)
    hidden_args = (norm_weight, norm_bias, eps, w1, b1, approximate)
    for b in range(B):
        hbuf[0].zero_()  # above the top row
        _hidden_rows_(xr[b, :min(R + 1, H)], *hidden_args, hbuf[1:min(R + 1, H) + 1])
        for r0 in range(0, H, R):
            m = min(R, H - r0)
            if r0 > 0:  # carry rows r0 - 1 and r0 over from the band above, then rows r0 + 1 ..
                hbuf[0] = hbuf[R]  # one row at a time: with R = 1 the ranges overlap
                hbuf[1] = hbuf[R + 1]
                end = min(r0 + m + 1, H)
                if end > r0 + 1:
                    _hidden_rows_(xr[b, r0 + 1:end], *hidden_args, hbuf[2:end - r0 + 1])
            if r0 + m == H:  # below the bottom row
                hbuf[m + 1].zero_()
            # (1, hidden, m + 2, W) with channels-last strides, the batch stride included (the
            # convs copy any other layout to NCHW)
            hb = hbuf[:m + 2].unsqueeze(0).permute(0, 3, 1, 2)
            c = F.conv2d(hb, dw_weight, dw_bias, 1, (0, 1), 1, hidden)  # (1, hidden, m, W)
            c = c.add_(hb[:, :, 1:m + 1]).permute(0, 2, 3, 1).reshape(m * W, hidden)
            out = linear_into(c, w2, b2, y[:m * W])
            if scale is not None:
                out.mul_(scale)
            xr[b, r0:r0 + m].add_(out.view(m, W, C))
    return x
