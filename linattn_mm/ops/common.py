"""Pieces shared by the torch kernels of :mod:`linattn_mm.ops`."""
import warnings

import torch

__all__ = ['grad_needed', 'sign_split', 'TRITON_FAILURE', 'note_triton_failure']

#: the first error of an automatically selected Triton call in this process; from then on the
#: modules run their torch kernels (a failing compiler or driver never stops inference)
TRITON_FAILURE = []


def note_triton_failure(owner, exc, failures=None):
    """Record ``exc`` of an automatically selected Triton call in ``failures`` (default
    :data:`TRITON_FAILURE`) and warn that the torch kernel takes over."""
    failures = TRITON_FAILURE if failures is None else failures
    failures.append(f'{type(exc).__name__}: {exc}')
    warnings.warn(f'{owner}: the Triton kernel failed ({failures[0][:500]}); the torch kernel '
                  f"runs instead for the rest of this process (fused='triton' raises the error)",
                  stacklevel=3)


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
