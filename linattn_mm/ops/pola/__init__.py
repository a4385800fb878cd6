"""Kernels of PolaFormer's polarity-aware linear attention, behind one signature::

    core(q, k, v, p, eps, temperature=None, k_bias=None) -> (B, h, N, d)

q (B, h, N, d), k and v (B, h, n, d) per head; ``p`` the exponents (1, h, 1, d); ``temperature``
``softplus(scale)`` (1, h, 1, d); ``k_bias`` the position encoding added to k.

* :mod:`.reference` — the official order of operations, the oracle (``core='reference'``);
* :mod:`.fast` — the torch kernel: one power per tensor, one query-side GEMM for both streams and
  their normalisers, the temperature and ``n^-1/2`` folded; with :mod:`.autograd`, the training
  Function that keeps only q, k, v and one small matrix per head for its analytic backward
  (``core='fast'``, the default);
* :mod:`.fused` — the torch kernel's products with its elementwise passes (the features, the
  output's gradient, the features' gradients) as three Triton kernels, a training core for CUDA
  (``core='fused'``);
* :mod:`.triton` — the Triton kernels, forward and backward on CUDA (``core='triton'``; set by
  :func:`linattn_mm.deploy.convert` for CUDA inference, chosen in ``attn_cfg`` for training);
* :mod:`.chunked_cpu` — the whole layer in CPU inference, chunk by chunk (a layer form, used by
  :func:`linattn_mm.deploy.convert`).

:func:`polarity_attention` runs the core a mixer names.
"""
from ..common import core_dtype, no_autocast
from ..dispatch import check_core
from .autograd import polarity_attention_fast
from .fast import polarity_features
from .reference import polarity_attention_reference, polarity_weights_reference

__all__ = ['polarity_attention', 'polarity_attention_reference', 'polarity_attention_fast',
           'polarity_features', 'polarity_weights_reference']

_TORCH_CORES = {'reference': polarity_attention_reference, 'fast': polarity_attention_fast}


def polarity_attention(q, k, v, p, eps=1e-6, temperature=None, k_bias=None, core='fast'):
    """The Pola core named ``core`` (``'reference'``, ``'fast'``, ``'fused'`` or ``'triton'``).

    The torch cores run with autocast off in float32 (float64 inputs stay float64): ``p`` reaches
    ``1 + alpha``, so the powers overflow float16. The fast core takes q, k, v and ``k_bias`` in
    their own dtype and casts them chunk by chunk (under autocast it keeps the half-precision
    projections for backward, not float32 copies). The Triton core reads the inputs in their own
    dtype and computes in float32, and so does the fused core (its products in torch, with
    autocast off). The result has the dtype of ``v``.
    """
    check_core('polarity_attention', core)
    if core == 'fused':
        from .fused import polarity_attention_fused
        with no_autocast(q.device):
            return polarity_attention_fused(q, k, v, p, eps, temperature, k_bias,
                                            out_dtype=v.dtype)
    if core == 'triton':
        from .triton import polarity_attention_triton
        return polarity_attention_triton(q, k, v, p, eps, temperature, k_bias, out_dtype=v.dtype)
    work, out_dtype = core_dtype(q, k, v), v.dtype
    with no_autocast(q.device):
        if core != 'fast':
            q, k, v = q.to(work), k.to(work), v.to(work)
            k_bias = None if k_bias is None else k_bias.to(work)
        out = _TORCH_CORES[core](q, k, v, p.to(work), eps,
                                 None if temperature is None else temperature.to(work), k_bias)
    return out.to(out_dtype)
