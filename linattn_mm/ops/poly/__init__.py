"""Kernels of Poly-SA (third-order polynomial self-attention): the weighted pooling of K ⊙ V over
positions (per region of a shifted Swin window) and its spreading back over the positions. The
formulas are in :mod:`linattn_mm.models.attentions.poly`."""
import torch
import torch.nn.functional as F

__all__ = ['poly_pool', 'poly_spread', 'region_onehot']


def poly_pool(kv, weight, regions=None):
    """Weighted pooling of ``kv`` over positions: ``s[.., r, :] = sum_n weight[h, n] kv[.., h, n, :]``
    over the positions ``n`` of region ``r``.

    Args:
        kv (Tensor): (B, h, n, d) the products K ⊙ V.
        weight (Tensor): (h, n) pooling weights p2.
        regions (Tensor, optional): (B, n, R) one-hot region of every position (all zeros: not
            pooled), see :func:`region_onehot`. With ``None`` every position is in one region.

    Returns:
        Tensor: (B, h, R, d).
    """
    if regions is None:
        return torch.einsum('hn,bhnd->bhd', weight, kv).unsqueeze(2)
    return torch.einsum('bnr,hn,bhnd->bhrd', regions, weight, kv)


def poly_spread(q, weight, pooled, regions=None):
    """``y[.., h, n, :] = q[.., h, n, :] * weight[h, n] * pooled[.., h, region(n), :]``; positions in
    no region get 0.

    Args:
        q (Tensor): (B, h, n, d). weight (Tensor): (h, n) p1. pooled (Tensor): (B, h, R, d).
        regions (Tensor, optional): (B, n, R) as in :func:`poly_pool`.
    """
    if regions is None:
        return q * weight[None, :, :, None] * pooled
    return q * weight[None, :, :, None] * torch.einsum('bnr,bhrd->bhnd', regions, pooled)


def region_onehot(region, num_regions, dtype):
    """(..., n) integer regions (-1: none) -> (..., n, R) one-hot rows (all zeros for -1)."""
    onehot = F.one_hot(region.clamp(min=0), num_regions).to(dtype)
    return onehot * (region >= 0).unsqueeze(-1).to(dtype)
