"""Tokens laid out on a grid: the token <-> map views, and the resizing of tables laid out on a
grid (position embeddings / encodings)."""
import functools

import torch
import torch.nn.functional as F

from .constants import shape_constant


def nlc_to_nchw(x, hw_shape):
    """Tokens (B, N, C) on an H x W grid as a (B, C, H, W) map. For contiguous tokens this is a
    view with channels-last strides, the batch stride included (``transpose(1, 2).reshape(...)``
    gives batch stride C when B = 1, which the convs do not take for channels-last and copy to
    NCHW first)."""
    B, N, C = x.shape
    H, W = hw_shape
    return x.reshape(B, H, W, C).permute(0, 3, 1, 2)


def nchw_to_nlc(x):
    """A (B, C, H, W) map as tokens (B, H*W, C) (a view of a channels-last map)."""
    return x.flatten(2).transpose(1, 2)


@functools.lru_cache(maxsize=256)
def _interp_matrix(n_in, n_out, mode):
    """(n_out, n_in) float64 matrix of 1-D ``mode`` interpolation (``align_corners=False``): the
    interpolation of each basis vector, i.e. exactly the weights ``F.interpolate`` uses along one
    axis (its 2-D bilinear / bicubic kernels are products of these 1-D weights)."""
    eye = torch.eye(n_in, dtype=torch.float64).view(1, n_in, n_in, 1)
    out = F.interpolate(eye, size=(n_out, 1), mode='bilinear' if mode == 'bilinear' else mode,
                        align_corners=False)
    return out[0, :, :, 0].t().contiguous()


@shape_constant(maxsize=256)
def interp_matrix(n_in, n_out, mode, dtype, device):
    """:func:`_interp_matrix` in ``dtype`` on ``device``, made once per arguments
    (:func:`~linattn_mm.models.utils.constants.shape_constant`: a resize in every forward does not
    copy it from the host again, a copy that would wait for the GPU); not to be modified."""
    return _interp_matrix(int(n_in), int(n_out), mode).to(device=device, dtype=dtype)


def resize_grid_embed(embed, src_hw, dst_hw, num_extra_tokens=0, mode='bicubic'):
    """Resize a (1, E + h*w, C) table laid out row-major on ``src_hw`` to ``dst_hw``; the E extra
    (class) token rows are kept. ``mode``: ``'bicubic'`` or ``'bilinear'`` (``align_corners=False``,
    the values of ``F.interpolate``). The separable interpolation is computed as two small matrix
    products on the token layout, ``A_h (G A_w^T)``, which is several times faster than
    ``F.interpolate`` and its backward at detection sizes. Half-precision tables are resized in
    float32, others in their own dtype (float64 stays float64)."""
    if tuple(src_hw) == tuple(dst_hw):
        return embed
    if mode not in ('bicubic', 'bilinear'):
        raise ValueError(f"resize_grid_embed: mode must be 'bicubic' or 'bilinear', got {mode!r}")
    extra, grid = embed[:, :num_extra_tokens], embed[:, num_extra_tokens:]
    (h, w), (H, W) = src_hw, dst_hw
    C = grid.shape[-1]
    work = torch.float32 if grid.dtype in (torch.float16, torch.bfloat16) else grid.dtype
    g = grid.to(work).reshape(h, w, C)
    a_h = interp_matrix(h, H, mode, work, grid.device)
    a_w = interp_matrix(w, W, mode, work, grid.device)
    out = (a_h @ (a_w @ g).reshape(h, W * C)).reshape(1, H * W, C).to(embed.dtype)
    return torch.cat([extra, out], dim=1) if num_extra_tokens else out
