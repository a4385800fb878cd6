"""Pieces shared by the torch kernels of :mod:`linattn_mm.ops`."""
import torch

__all__ = ['grad_needed', 'sign_split']


def grad_needed(*tensors):
    """True when autograd is on and any of ``tensors`` (None entries allowed) requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def sign_split(c):
    """``[relu(c), relu(-c)]`` (..., 2d) of a signed tensor ``c`` (..., d), written into one new
    contiguous buffer with two ops (``clamp_min``, then ``relu(c) - c == relu(-c)``, exact).
    Inference form: ``out=`` writes make no autograd graph."""
    d = c.shape[-1]
    out = torch.empty(*c.shape[:-1], 2 * d, dtype=c.dtype, device=c.device)
    pos = torch.clamp_min(c, 0, out=out[..., :d])
    torch.sub(pos, c, out=out[..., d:])
    return out
