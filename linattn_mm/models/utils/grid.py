"""Tokens laid out on a grid: the token <-> map views, and the resizing of tables laid out on a
grid (position embeddings / encodings)."""
import torch
import torch.nn.functional as F


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


def resize_grid_embed(embed, src_hw, dst_hw, num_extra_tokens=0, mode='bicubic'):
    """Resize a (1, E + h*w, C) table laid out row-major on ``src_hw`` to ``dst_hw``; the E extra
    (class) token rows are kept. Half-precision tables are interpolated in float32, others in
    their own dtype (float64 stays float64)."""
    if tuple(src_hw) == tuple(dst_hw):
        return embed
    extra, grid = embed[:, :num_extra_tokens], embed[:, num_extra_tokens:]
    C = grid.shape[-1]
    grid = grid.reshape(1, src_hw[0], src_hw[1], C).permute(0, 3, 1, 2)
    work = grid.float() if grid.dtype in (torch.float16, torch.bfloat16) else grid
    grid = F.interpolate(work, size=tuple(dst_hw), mode=mode, align_corners=False)
    grid = grid.to(embed.dtype).flatten(2).transpose(1, 2)
    return torch.cat([extra, grid], dim=1) if num_extra_tokens else grid
