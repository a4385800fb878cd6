"""Kernels of NaLaFormer's norm-aware linear attention, behind one signature::

    core(q, k, v, power, eps, sin=None, cos=None) -> (B, h, N, d)

q, k, v (B, h, N, d) per head; ``power`` is ``lam``; ``sin``/``cos`` the 2-D RoPE (N, d) on the
numerator features, or None.

* :mod:`.reference` — the official order of operations and the paper's cos/sin kernel, the oracle
  (``core='reference'``);
* :mod:`.fast` — the torch kernel of the official kernel: one ``exp2`` per query element for the
  power, the RoPE folded into the small matrices; with :mod:`.autograd`, the training Function
  that keeps q, k, v and small matrices for its analytic backward (``core='fast'``, the default;
  the paper's kernel: its reference recomputed in the backward);
* :mod:`.fused` — the torch kernel's products with its elementwise passes (features, RoPE,
  their gradients) as three Triton kernels, a training core for CUDA (``core='fused'``, official
  kernel);
* :mod:`.triton` — the Triton kernels of the official kernel, forward and backward on CUDA
  (``core='triton'``; set by :func:`linattn_mm.deploy.convert` for CUDA inference, chosen in
  ``attn_cfg`` for training);
* :mod:`.chunked_cpu` — the whole layer in CPU inference, chunk by chunk (used by
  :func:`linattn_mm.deploy.convert`).

:func:`nala_attention` runs the core a mixer names.
"""
from ..common import core_dtype, no_autocast
from ..dispatch import check_core
from .autograd import nala_attention_fast
from .fast import RopeTables, rope_turn, rope_turns, rotate_pairs
from .reference import (KERNELS, apply_rope, nala_attention_reference, nala_feature_maps,
                        nala_weights_reference, rotate_every_two)

__all__ = ['nala_attention', 'nala_attention_reference', 'nala_attention_fast', 'apply_rope',
           'rotate_every_two', 'RopeTables', 'rope_turn', 'rope_turns', 'rotate_pairs',
           'nala_feature_maps', 'nala_weights_reference', 'KERNELS', 'OFFICIAL_ONLY_CORES',
           'core_refusal']

#: the NaLa cores that run the official kernel with the norm-aware power only, by their names in
#: errors
OFFICIAL_ONLY_CORES = {'triton': 'Triton', 'fused': 'fused'}


def core_refusal(core, kernel, query_power):
    """Why the NaLa core ``core`` cannot run the feature map ``kernel`` with ``query_power``
    (a sentence for an error), or None when it can."""
    kind = OFFICIAL_ONLY_CORES.get(core)
    if kind and kernel != 'official':
        return f'kernel={kernel!r} has no {kind} core'
    if kind and query_power is not None:
        return f'a constant query_power has no {kind} core'
    return None


def nala_attention(q, k, v, power=3., eps=1e-6, sin=None, cos=None, kernel='official',
                   core='fast', query_power=None, out_dtype=None, v_keep=None):
    """The NaLa core named ``core`` (``'reference'``, ``'fast'``, ``'fused'`` or ``'triton'``) for
    the feature map ``kernel`` (``'official'`` or ``'paper'``; the paper's kernel has no Triton
    or fused core). Torch cores run with autocast off in float32 (float64 stays float64), as the
    official code; the Triton core reads the inputs as they are and computes in float32, and so
    does the fused core (its products in torch, with autocast off). The fast core takes q, k, v
    in their own dtype and casts them itself (under autocast it keeps the half-precision
    projections for backward, not float32 copies; ``v_keep``: a lower-precision twin of ``v`` to
    keep instead, see :class:`~linattn_mm.ops.nala.autograd.NormAwareAttention`; the Triton core
    reads it instead of ``v`` too). The result has
    the dtype ``out_dtype``, by default that of ``v``. ``query_power``: a constant query exponent
    instead of the norm-aware ``power * (0.5 + tanh ||q||)`` (the paper's Table 5 ablation; no
    Triton or fused core)."""
    check_core('nala_attention', core)
    refusal = core_refusal(core, kernel, query_power)
    if refusal:
        raise ValueError(f'nala_attention: {refusal}')
    if core == 'triton':
        from .triton import nala_attention_triton
        return nala_attention_triton(q, k, v, power, eps, sin, cos,
                                     out_dtype=out_dtype or v.dtype, v_keep=v_keep)
    work = core_dtype(q, k, v)
    sin, cos = (None, None) if sin is None else (sin.to(work), cos.to(work))
    if core == 'fused':
        from .fused import nala_attention_fused
        with no_autocast(q.device):
            out = nala_attention_fused(q, k, v, power, eps, sin, cos, v_keep)
        return out.to(out_dtype or v.dtype)
    with no_autocast(q.device):
        if core == 'fast':  # casts inside: keeps half-precision inputs, not float32 copies
            out = nala_attention_fast(q, k, v, power, eps, sin, cos, kernel, query_power, v_keep)
        else:
            out = nala_attention_reference(q.to(work), k.to(work), v.to(work), power, eps, sin,
                                           cos, kernel, query_power)
    return out.to(out_dtype or v.dtype)
