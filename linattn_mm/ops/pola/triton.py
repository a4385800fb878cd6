"""Triton kernels of PolaFormer's polarity-aware linear attention core (non-causal), for CUDA
inference and training.

Same maths as :func:`linattn_mm.ops.pola.fast.polarity_attention_fast` (and the reference
:func:`~linattn_mm.ops.pola.reference.polarity_attention_reference`), in two passes over the tokens with the feature maps made in registers:

1. **Keys** (grid: batch·heads × key chunks). Each program reads its chunk of ``k`` (and of the
   position encoding) and ``v`` once, makes ``y = (k + pe) / s`` and the polarity features
   ``k+ = relu(y)^p``, ``k- = relu(-y)^p`` in float32 (one ``exp2(p·log2|y|)`` per element, the sign
   picks the half), and accumulates ``k+ᵀv``, ``k-ᵀv`` (d × d) and the key sums ``Σk+``, ``Σk-`` in
   float32. Partial sums per chunk go to a small buffer that torch adds up; the two per-stream
   matrices ``W+ = [k+ᵀv_s | k-ᵀv_o] / n`` and ``W- = [k-ᵀv_s | k+ᵀv_o] / n`` are then built
   (``q_opp @ X == q_sim @ swap(X)``, see :mod:`linattn_mm.ops.pola.fast`).
2. **Queries** (grid: batch·heads × query blocks). Each program reads a block of ``q``, makes
   ``q+``, ``q-`` the same way, computes the numerators ``q+ W+ + q- W-`` and the two
   denominators (same-signed ``q+·k̄+ + q-·k̄-``, opposite ``q+·k̄- + q-·k̄+``, plus ``eps``) and
   writes the normalised result straight into a ``(B, N, h, d)`` buffer (merging the heads is free).

Inputs may be float32, bfloat16 or float16 (read as they are; every feature, product and sum is
float32; the output has ``out_dtype``). The matmuls use ``input_precision='ieee'`` (no TF32): they
are d × d per token and were meant to leave the kernel bound by memory traffic; Triton lowers them
to FMA loops. :func:`~linattn_mm.ops.dispatch.triton_dot_precision` compiles them for the tensor
cores instead (``'tf32x3'``, ``'tf32'``: the ``PREC`` of every kernel), a switch to measure that on
a GPU, not a default. Head dims are padded to a power of two ≥ 16 inside the kernel (masked
loads), so any ``d`` works. Every launch fits its pipeline stages to the device's shared memory
(:func:`~linattn_mm.ops.dispatch.launch_fitted`); the warps of a program and the tokens it takes
per step depend on the head dim and on the pass (:func:`~linattn_mm.ops.dispatch.core_launch`: at
d = 64 more warps and smaller blocks, and up to d = 32 the gradient passes more warps and smaller
blocks than the forward's, which keep the accumulators out of local memory).

**Training** (:class:`PolarityAttentionTriton`, the autograd Function of the two passes above):
the forward keeps q, k, v (as they came, in their dtype), the parameters and the small per-head
state (``W+``, ``W-``, the key means); the backward is two more passes that recompute the
features in registers, as in :mod:`linattn_mm.ops.pola.autograd` (same formulas):

3. **Query gradients** (grid: batch·heads × query chunks). From a block of ``q`` and of the output
   gradient ``g``: ``r = q+ W+ + q- W-``, ``dnum = g / D``, ``dden_t = -Σ_{c∈t} g_c out_c / D_t``;
   ``dq± = dnum W±ᵀ + dden·(key means)``, then through the powers ``dy = (dq± a) p / y``; writes dq
   and accumulates ``dW± = q±ᵀ dnum``, the key means' gradient, and the exponent's and
   temperature's sums per chunk.
4. **Key gradients** (grid: batch·heads × key chunks). From a block of ``k`` (+ the position
   encoding) and ``v``: ``dv = k+ dKV+ + k- dKV-``, ``dk± = v dKV±ᵀ + d(mean k±)`` and the same
   chain through the powers; writes dv and dk.

Each tensor of size (B, h, N, d) is read or written once per pass: about 4 reads and 1 write in
the forward, 6 reads and 3 writes in the backward, against some 40 full-size passes of the eager
torch Function. ``core='triton'`` on the mixer (inference and training; CUDA only), which
:func:`linattn_mm.deploy.convert` sets for CUDA inference (head dims up to 32). With
``TRITON_INTERPRET=1`` the same kernels run on CPU tensors through Triton's interpreter, which is
how the tests check them (and their gradients against the float64 reference) on machines without
a GPU.
"""
import math
from typing import Optional, Tuple

import torch
from torch.utils.flop_counter import register_flop_formula

from linattn_mm.utils.op_counter import register_compute_dtype

from ..common import backward_without_autocast
from ..dispatch import (TRITON_DTYPES, core_blocks, core_launch, dot_precision, launch_fitted,
                        multiprocessors, padded_head_dims, triton_available, triton_module)

triton = triton_module()  # Triton ships with the CUDA builds of torch; the torch cores never need it
if triton is not None:
    import triton.language as tl

__all__ = ['polarity_attention_triton', 'PolarityAttentionTriton', 'check_qkv']

_LN2 = math.log(2.)


if triton is not None:

    @triton.jit
    def _program(h, D: tl.constexpr, DP: tl.constexpr):
        """This program's (batch·head, chunk) indices, its batch item and head, the channel range
        (padded to DP) and its mask (the channels below D)."""
        bh = tl.program_id(0)
        rd = tl.arange(0, DP)
        return bh, tl.program_id(1), bh // h, bh % h, rd, rd < D

    @triton.jit
    def _load_tile(ptr, b, head, rows, rd, s_b, s_h, s_n, s_d, mask):
        """Tile ``[rows, rd]`` of batch item ``b``, head ``head`` of a (B, h, L, d) tensor with
        strides ``s_*``, as float32 (zero outside ``mask``)."""
        return tl.load(ptr + b * s_b + head * s_h + rows[:, None] * s_n + rd[None, :] * s_d,
                       mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _features(x, p):
        """(relu(x)^p, relu(-x)^p) of a float32 tile, one exp2/log2 per element (0 -> 0)."""
        a = tl.exp2(p * tl.log2(tl.abs(x)))
        return tl.where(x > 0, a, 0.0), tl.where(x < 0, a, 0.0)

    @triton.jit
    def _pola_keys_kernel(K, V, PE, P, S, KV, KS, n, h, chunk,
                          s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                          s_pb, s_ph, s_pn, s_pd,
                          D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr,
                          HAS_PE: tl.constexpr, HAS_SCALE: tl.constexpr, PREC: tl.constexpr):
        bh, split, b, head, rd, dmask = _program(h, D, DP)
        p = tl.load(P + head * D + rd, mask=dmask, other=1.0)
        if HAS_SCALE:
            inv_s = tl.load(S + head * D + rd, mask=dmask, other=1.0)
        acc_pos = tl.zeros((DP, DP), dtype=tl.float32)
        acc_neg = tl.zeros((DP, DP), dtype=tl.float32)
        sum_pos = tl.zeros((DP, ), dtype=tl.float32)
        sum_neg = tl.zeros((DP, ), dtype=tl.float32)
        start = split * chunk
        for off in range(0, chunk, BLOCK_N):
            rn = start + off + tl.arange(0, BLOCK_N)
            m = (rn < n)[:, None] & dmask[None, :]
            y = _load_tile(K, b, head, rn, rd, s_kb, s_kh, s_kn, s_kd, m)
            if HAS_PE:
                y += _load_tile(PE, b, head, rn, rd, s_pb, s_ph, s_pn, s_pd, m)
            if HAS_SCALE:
                y = y * inv_s[None, :]
            kp, kn = _features(y, p[None, :])
            v = _load_tile(V, b, head, rn, rd, s_vb, s_vh, s_vn, s_vd, m)
            acc_pos += tl.dot(tl.trans(kp), v, input_precision=PREC)
            acc_neg += tl.dot(tl.trans(kn), v, input_precision=PREC)
            sum_pos += tl.sum(kp, axis=0)
            sum_neg += tl.sum(kn, axis=0)
        # partial sums of this chunk: KV (B*h, splits, 2, DP, DP), KS (B*h, splits, 2, DP)
        n_split = tl.num_programs(1)
        kv = KV + (bh * n_split + split) * 2 * DP * DP + rd[:, None] * DP + rd[None, :]
        tl.store(kv, acc_pos)
        tl.store(kv + DP * DP, acc_neg)
        ks = KS + (bh * n_split + split) * 2 * DP + rd
        tl.store(ks, sum_pos)
        tl.store(ks + DP, sum_neg)

    @triton.jit
    def _pola_queries_kernel(Q, W, KS, P, S, O, N, h, eps,
                             s_qb, s_qh, s_qn, s_qd, s_ob, s_on, s_oh, s_od,
                             D: tl.constexpr, D_SAME: tl.constexpr, DP: tl.constexpr,
                             BLOCK_M: tl.constexpr, HAS_SCALE: tl.constexpr, PREC: tl.constexpr):
        bh = tl.program_id(0)
        b = bh // h
        head = bh % h
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rd = tl.arange(0, DP)
        dmask = rd < D
        m = (rm < N)[:, None] & dmask[None, :]
        p = tl.load(P + head * D + rd, mask=dmask, other=1.0)
        y = _load_tile(Q, b, head, rm, rd, s_qb, s_qh, s_qn, s_qd, m)
        if HAS_SCALE:
            y = y * tl.load(S + head * D + rd, mask=dmask, other=1.0)[None, :]
        qp, qn = _features(y, p[None, :])
        w = W + bh * 2 * DP * DP + rd[:, None] * DP + rd[None, :]
        num = tl.dot(qp, tl.load(w), input_precision=PREC)
        num += tl.dot(qn, tl.load(w + DP * DP), input_precision=PREC)
        ks_pos = tl.load(KS + bh * 2 * DP + rd)  # key means (sums / n), zero on the padding
        ks_neg = tl.load(KS + bh * 2 * DP + DP + rd)
        den_same = tl.sum(qp * ks_pos[None, :] + qn * ks_neg[None, :], axis=1) + eps
        den_opp = tl.sum(qp * ks_neg[None, :] + qn * ks_pos[None, :], axis=1) + eps
        den = tl.where((rd < D_SAME)[None, :], den_same[:, None], den_opp[:, None])
        out = num / den
        tl.store(O + b * s_ob + rm[:, None] * s_on + head * s_oh + rd[None, :] * s_od,
                 out.to(O.dtype.element_ty), mask=m)

    @triton.jit
    def _power_terms(x, p):
        """``log2|x|``, ``a = |x|^p`` and the features ``relu(x)^p``, ``relu(-x)^p`` of a float32
        tile (0 -> 0; ``log2`` is -inf there and is masked by the caller)."""
        l2 = tl.log2(tl.abs(x))
        a = tl.exp2(p * l2)
        return l2, a, tl.where(x > 0, a, 0.0), tl.where(x < 0, a, 0.0)

    @triton.jit
    def _power_grads(y, l2, a, dpos, dneg, p):
        """From the gradients of the features ``relu(y)^p``, ``relu(-y)^p`` to that of ``y`` and
        the per-element term of the exponent's (in units of ln 2): ``G = da·a``,
        ``dy = G p / y``, ``dp = G log2|y|``, both 0 where y = 0 (as in the reference)."""
        g = tl.where(y > 0, dpos, tl.where(y < 0, dneg, 0.0)) * a
        nz = y != 0
        return tl.where(nz, g * p / y, 0.0), tl.where(nz, g * l2, 0.0)

    @triton.jit
    def _pola_query_grad_kernel(Q, G, W, KS, P, S, DQ, DW, DM, DINV, DPOW, N, h, chunk, eps,
                                s_qb, s_qh, s_qn, s_qd, s_gb, s_gh, s_gn, s_gd,
                                s_db, s_dh, s_dn, s_dd,
                                D: tl.constexpr, D_SAME: tl.constexpr, DP: tl.constexpr,
                                BLOCK_M: tl.constexpr, HAS_SCALE: tl.constexpr, PREC: tl.constexpr):
        bh, split, b, head, rd, dmask = _program(h, D, DP)
        same = (rd < D_SAME)[None, :]
        p = tl.load(P + head * D + rd, mask=dmask, other=1.0)
        if HAS_SCALE:
            inv_s = tl.load(S + head * D + rd, mask=dmask, other=1.0)
        w = W + bh * 2 * DP * DP + rd[:, None] * DP + rd[None, :]
        w_pos = tl.load(w)
        w_neg = tl.load(w + DP * DP)
        m_pos = tl.load(KS + bh * 2 * DP + rd)
        m_neg = tl.load(KS + bh * 2 * DP + DP + rd)
        dw_pos = tl.zeros((DP, DP), dtype=tl.float32)
        dw_neg = tl.zeros((DP, DP), dtype=tl.float32)
        dm_pos = tl.zeros((DP, ), dtype=tl.float32)
        dm_neg = tl.zeros((DP, ), dtype=tl.float32)
        d_inv = tl.zeros((DP, ), dtype=tl.float32)
        d_pow = tl.zeros((DP, ), dtype=tl.float32)
        start = split * chunk
        for off in range(0, chunk, BLOCK_M):
            rm = start + off + tl.arange(0, BLOCK_M)
            m = (rm < N)[:, None] & dmask[None, :]
            x = _load_tile(Q, b, head, rm, rd, s_qb, s_qh, s_qn, s_qd, m)
            y = x
            if HAS_SCALE:
                y = x * inv_s[None, :]
            l2, a, qp, qn = _power_terms(y, p[None, :])
            num = tl.dot(qp, w_pos, input_precision=PREC)
            num += tl.dot(qn, w_neg, input_precision=PREC)
            den_same = tl.sum(qp * m_pos[None, :] + qn * m_neg[None, :], axis=1) + eps
            den_opp = tl.sum(qp * m_neg[None, :] + qn * m_pos[None, :], axis=1) + eps
            den = tl.where(same, den_same[:, None], den_opp[:, None])
            g = _load_tile(G, b, head, rm, rd, s_gb, s_gh, s_gn, s_gd, m)
            dnum = g / den
            t = dnum * num / den
            dden_same = -tl.sum(tl.where(same, t, 0.0), axis=1)
            dden_opp = -tl.sum(tl.where(same, 0.0, t), axis=1)
            dw_pos += tl.dot(tl.trans(qp), dnum, input_precision=PREC)
            dw_neg += tl.dot(tl.trans(qn), dnum, input_precision=PREC)
            dm_pos += tl.sum(qp * dden_same[:, None] + qn * dden_opp[:, None], axis=0)
            dm_neg += tl.sum(qn * dden_same[:, None] + qp * dden_opp[:, None], axis=0)
            dqp = tl.dot(dnum, tl.trans(w_pos), input_precision=PREC) + \
                dden_same[:, None] * m_pos[None, :] + dden_opp[:, None] * m_neg[None, :]
            dqn = tl.dot(dnum, tl.trans(w_neg), input_precision=PREC) + \
                dden_same[:, None] * m_neg[None, :] + dden_opp[:, None] * m_pos[None, :]
            dy, dpw = _power_grads(y, l2, a, dqp, dqn, p[None, :])
            d_pow += tl.sum(dpw, axis=0)
            if HAS_SCALE:
                d_inv += tl.sum(dy * x, axis=0)
                dy = dy * inv_s[None, :]
            tl.store(DQ + b * s_db + head * s_dh + rm[:, None] * s_dn + rd[None, :] * s_dd,
                     dy.to(DQ.dtype.element_ty), mask=m)
        # partial sums of this chunk: DW (B*h, splits, 2, DP, DP), DM (B*h, splits, 2, DP),
        # DINV and DPOW (B*h, splits, DP)
        part = bh * tl.num_programs(1) + split
        dw = DW + part * 2 * DP * DP + rd[:, None] * DP + rd[None, :]
        tl.store(dw, dw_pos)
        tl.store(dw + DP * DP, dw_neg)
        tl.store(DM + part * 2 * DP + rd, dm_pos)
        tl.store(DM + part * 2 * DP + DP + rd, dm_neg)
        tl.store(DINV + part * DP + rd, d_inv)
        tl.store(DPOW + part * DP + rd, d_pow)

    @triton.jit
    def _pola_key_grad_kernel(K, V, PE, P, S, DKV, DM, DK, DV, DINV, DPOW, n, h, chunk,
                              s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                              s_pb, s_ph, s_pn, s_pd, s_dkb, s_dkh, s_dkn, s_dkd,
                              s_dvb, s_dvh, s_dvn, s_dvd,
                              D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr,
                              HAS_PE: tl.constexpr, HAS_SCALE: tl.constexpr, WANT_DK: tl.constexpr,
                              WANT_DV: tl.constexpr, PREC: tl.constexpr):
        bh, split, b, head, rd, dmask = _program(h, D, DP)
        p = tl.load(P + head * D + rd, mask=dmask, other=1.0)
        if HAS_SCALE:
            inv_s = tl.load(S + head * D + rd, mask=dmask, other=1.0)
        dkv = DKV + bh * 2 * DP * DP + rd[:, None] * DP + rd[None, :]
        dkv_pos = tl.load(dkv)  # gradients of k+ᵀv, k-ᵀv (the 1 / n included)
        dkv_neg = tl.load(dkv + DP * DP)
        dm_pos = tl.load(DM + bh * 2 * DP + rd)  # of the key sums
        dm_neg = tl.load(DM + bh * 2 * DP + DP + rd)
        d_inv = tl.zeros((DP, ), dtype=tl.float32)
        d_pow = tl.zeros((DP, ), dtype=tl.float32)
        start = split * chunk
        for off in range(0, chunk, BLOCK_N):
            rn = start + off + tl.arange(0, BLOCK_N)
            m = (rn < n)[:, None] & dmask[None, :]
            x = _load_tile(K, b, head, rn, rd, s_kb, s_kh, s_kn, s_kd, m)
            if HAS_PE:
                x += _load_tile(PE, b, head, rn, rd, s_pb, s_ph, s_pn, s_pd, m)
            y = x
            if HAS_SCALE:
                y = x * inv_s[None, :]
            l2, a, kp, kn = _power_terms(y, p[None, :])
            v = _load_tile(V, b, head, rn, rd, s_vb, s_vh, s_vn, s_vd, m)
            if WANT_DV:
                dv = tl.dot(kp, dkv_pos, input_precision=PREC)
                dv += tl.dot(kn, dkv_neg, input_precision=PREC)
                tl.store(DV + b * s_dvb + head * s_dvh + rn[:, None] * s_dvn + rd[None, :] * s_dvd,
                         dv.to(DV.dtype.element_ty), mask=m)
            dkp = tl.dot(v, tl.trans(dkv_pos), input_precision=PREC) + dm_pos[None, :]
            dkn = tl.dot(v, tl.trans(dkv_neg), input_precision=PREC) + dm_neg[None, :]
            dy, dpw = _power_grads(y, l2, a, dkp, dkn, p[None, :])
            d_pow += tl.sum(dpw, axis=0)
            if HAS_SCALE:
                d_inv += tl.sum(dy * x, axis=0)
                dy = dy * inv_s[None, :]
            if WANT_DK:
                tl.store(DK + b * s_dkb + head * s_dkh + rn[:, None] * s_dkn + rd[None, :] * s_dkd,
                         dy.to(DK.dtype.element_ty), mask=m)
        part = bh * tl.num_programs(1) + split
        tl.store(DINV + part * DP + rd, d_inv)
        tl.store(DPOW + part * DP + rd, d_pow)


def _per_head(t, h, d, name, fn='polarity_attention_triton'):
    """``t`` broadcastable to (1, h, 1, d) -> contiguous float32 (h, d) (errors named by the
    core function ``fn``)."""
    try:
        return t.to(torch.float32).expand(1, h, 1, d).reshape(h, d).contiguous()
    except RuntimeError as e:
        raise ValueError(f'{fn}: {name} of shape {tuple(t.shape)} does not broadcast to (1, {h}, '
                         f'1, {d})') from e


def check_qkv(fn, q, k, v, meta=False):
    """Validate per-head ``q`` (B, h, N, d), ``k``, ``v`` (B, h, n, d) for a Triton core named
    ``fn``: Triton present, shapes, dtypes and device (``meta``: ``meta`` tensors allowed, whose
    launches only make their outputs). Returns ``B, h, N, n, d``."""
    if triton is None:
        raise RuntimeError(f'{fn} needs Triton (installed with the CUDA builds of torch)')
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f'{fn}: q, k, v must be (B, h, N, d), got '
                         f'{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}')
    B, h, N, d = q.shape
    n = k.shape[2]
    if k.shape != (B, h, n, d) or v.shape != (B, h, n, d):
        raise ValueError(f'{fn}: k and v must be (B, h, n, d) = (B={B}, h={h}, n, d={d}), got '
                         f'{tuple(k.shape)} and {tuple(v.shape)}')
    for name, t in (('q', q), ('k', k), ('v', v)):
        if t.dtype not in TRITON_DTYPES:
            raise TypeError(f'{fn}: {name} has dtype {t.dtype}; supported: '
                            f'{", ".join(str(x) for x in TRITON_DTYPES)}')
        if not (triton_available(t) or meta and t.device.type == 'meta'):
            raise RuntimeError(f'{fn}: {name} is on {t.device}; the kernel runs on CUDA tensors '
                               f'(or on CPU with TRITON_INTERPRET=1)')
    return B, h, N, n, d


def _num_splits(n, bh, block_n, device):
    """Key chunks per (batch, head): enough programs to fill the GPU twice over."""
    blocks = triton.cdiv(n, block_n)
    return max(1, min(blocks, triton.cdiv(2 * multiprocessors(device), bh)))


def _split(length, bh, block, device):
    """(programs per (batch, head), tokens per program) over ``length`` tokens."""
    splits = _num_splits(length, bh, block, device)
    chunk = triton.cdiv(triton.cdiv(length, splits), block) * block
    return triton.cdiv(length, chunk), chunk


def _same_columns(d, DP, device):
    """(1, DP) mask of the same-signed stream's value columns ``[0, ceil(d / 2))``."""
    return (torch.arange(DP, device=device) < (d + 1) // 2).view(1, DP)


_padded = padded_head_dims


# ------------------------------------------------------------------------------------------------
# The four launches as operators (``torch.ops.linattn_mm.pola_triton_*``): each is one kernel
# (plus its output buffers), seen by torch as one operation with its tensors, so that on ``meta``
# tensors the launches have shapes (their fake forms) and the operation and traffic counters of
# linattn_mm.utils count what each kernel reads and writes.
# ------------------------------------------------------------------------------------------------
_LIB = 'linattn_mm::'


def _partials(bh, splits, device, *tail):
    return torch.empty(bh, splits, *tail, device=device, dtype=torch.float32)


def _keys_outputs(k, block_n):
    B, h, n, d = k.shape
    DP = _padded(d)
    splits, chunk = _split(n, B * h, block_n, k.device)
    return (_partials(B * h, splits, k.device, 2, DP, DP),
            _partials(B * h, splits, k.device, 2, DP)), chunk


@torch.library.custom_op(_LIB + 'pola_triton_keys', mutates_args=())
def _keys_op(k: torch.Tensor, v: torch.Tensor, pe: Optional[torch.Tensor], p: torch.Tensor,
             inv_s: Optional[torch.Tensor], block_n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pass 1: per key chunk, the partial sums ``[k+ᵀv, k-ᵀv]`` (B·h, splits, 2, DP, DP) and
    ``[Σk+, Σk-]`` (B·h, splits, 2, DP)."""
    B, h, n, d = k.shape
    (kv, ks), chunk = _keys_outputs(k, block_n)
    pe_t = k if pe is None else pe
    launch_fitted(_pola_keys_kernel, (B * h, kv.shape[1]),
        k, v, pe_t, p, p if inv_s is None else inv_s, kv, ks, n, h, chunk, *k.stride(),
        *v.stride(), *pe_t.stride(), PREC=dot_precision(), num_warps=core_launch(d)[0], D=d,
        DP=_padded(d), BLOCK_N=block_n, HAS_PE=pe is not None, HAS_SCALE=inv_s is not None)
    return kv, ks


@_keys_op.register_fake
def _(k, v, pe, p, inv_s, block_n):
    return _keys_outputs(k, block_n)[0]


@torch.library.custom_op(_LIB + 'pola_triton_queries', mutates_args=())
def _queries_op(q: torch.Tensor, w: torch.Tensor, ks: torch.Tensor, p: torch.Tensor,
                inv_s: Optional[torch.Tensor], eps: float, block_m: int,
                out_dtype: torch.dtype) -> torch.Tensor:
    """Pass 2: the normalised output, a (B, N, h, d) buffer."""
    B, h, N, d = q.shape
    out = q.new_empty(B, N, h, d, dtype=out_dtype)
    launch_fitted(_pola_queries_kernel, (B * h, triton.cdiv(N, block_m)),
        q, w, ks, p, p if inv_s is None else inv_s, out, N, h, eps, *q.stride(), *out.stride(),
        PREC=dot_precision(), num_warps=core_launch(d)[0], D=d, D_SAME=(d + 1) // 2,
        DP=_padded(d), BLOCK_M=block_m, HAS_SCALE=inv_s is not None)
    return out


@_queries_op.register_fake
def _(q, w, ks, p, inv_s, eps, block_m, out_dtype):
    B, h, N, d = q.shape
    return q.new_empty(B, N, h, d, dtype=out_dtype)


def _query_grad_outputs(q, block_m):
    B, h, N, d = q.shape
    DP = _padded(d)
    splits, chunk = _split(N, B * h, block_m, q.device)
    parts = (_partials(B * h, splits, q.device, 2, DP, DP),
             _partials(B * h, splits, q.device, 2, DP),
             _partials(B * h, splits, q.device, DP), _partials(B * h, splits, q.device, DP))
    return (q.new_empty(B, N, h, d),) + parts, chunk


@torch.library.custom_op(_LIB + 'pola_triton_query_grads', mutates_args=())
def _query_grads_op(q: torch.Tensor, grad: torch.Tensor, w: torch.Tensor, ks: torch.Tensor,
                    p: torch.Tensor, inv_s: Optional[torch.Tensor], eps: float,
                    block_m: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor, torch.Tensor]:
    """Pass 3: dq (a (B, N, h, d) buffer in q's dtype) and the partial sums per query chunk of
    ``[dW+, dW-]``, of the key means' gradient, of the inverse temperature's and of the
    exponents' (the latter in units of ln 2)."""
    B, h, N, d = q.shape
    (dq, dw, dm, d_inv, d_pow), chunk = _query_grad_outputs(q, block_m)
    dq_t = dq.transpose(1, 2)
    launch_fitted(_pola_query_grad_kernel, (B * h, dw.shape[1]),
        q, grad, w, ks, p, p if inv_s is None else inv_s, dq_t, dw, dm, d_inv, d_pow, N, h,
        chunk, eps, *q.stride(), *grad.stride(), *dq_t.stride(),
        PREC=dot_precision(), num_warps=core_launch(d, 'backward')[0], D=d,
        D_SAME=(d + 1) // 2, DP=_padded(d), BLOCK_M=block_m, HAS_SCALE=inv_s is not None)
    return dq, dw, dm, d_inv, d_pow


@_query_grads_op.register_fake
def _(q, grad, w, ks, p, inv_s, eps, block_m):
    return _query_grad_outputs(q, block_m)[0]


def _key_grad_outputs(k, want_dk, want_dv, dk_dtype, v_dtype, block_n):
    B, h, n, d = k.shape
    DP = _padded(d)
    splits, chunk = _split(n, B * h, block_n, k.device)
    dk = k.new_empty((B, n, h, d) if want_dk else (0, ), dtype=dk_dtype)
    dv = k.new_empty((B, n, h, d) if want_dv else (0, ), dtype=v_dtype)
    return (dk, dv, _partials(B * h, splits, k.device, DP),
            _partials(B * h, splits, k.device, DP)), chunk


@torch.library.custom_op(_LIB + 'pola_triton_key_grads', mutates_args=())
def _key_grads_op(k: torch.Tensor, v: torch.Tensor, pe: Optional[torch.Tensor], p: torch.Tensor,
                  inv_s: Optional[torch.Tensor], dkv: torch.Tensor, dm: torch.Tensor,
                  want_dk: bool, want_dv: bool, dk_dtype: torch.dtype,
                  block_n: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 4: dk (the gradient of ``k + pe``) and dv, (B, n, h, d) buffers (empty where not
    wanted), and the partial sums per key chunk of the inverse temperature's and the exponents'
    gradients; ``dkv`` (B·h, 2, DP, DP) and ``dm`` (B·h, 2, DP) are those of ``[k+ᵀv, k-ᵀv]``
    and of the key sums."""
    B, h, n, d = k.shape
    (dk, dv, d_inv, d_pow), chunk = _key_grad_outputs(k, want_dk, want_dv, dk_dtype, v.dtype,
                                                      block_n)
    dk_t = dk.transpose(1, 2) if want_dk else k
    dv_t = dv.transpose(1, 2) if want_dv else v
    pe_t = k if pe is None else pe
    launch_fitted(_pola_key_grad_kernel, (B * h, d_inv.shape[1]),
        k, v, pe_t, p, p if inv_s is None else inv_s, dkv, dm, dk, dv, d_inv, d_pow, n, h, chunk,
        *k.stride(), *v.stride(), *pe_t.stride(), *dk_t.stride(), *dv_t.stride(),
        PREC=dot_precision(), num_warps=core_launch(d, 'backward')[0], D=d, DP=_padded(d),
        BLOCK_N=block_n, HAS_PE=pe is not None, HAS_SCALE=inv_s is not None, WANT_DK=want_dk,
        WANT_DV=want_dv)
    return dk, dv, d_inv, d_pow


@_key_grads_op.register_fake
def _(k, v, pe, p, inv_s, dkv, dm, want_dk, want_dv, dk_dtype, block_n):
    return _key_grad_outputs(k, want_dk, want_dv, dk_dtype, v.dtype, block_n)[0]


def register_dot_flops(factors):
    """FLOP formulas of launches (operator name -> ``factor``) whose matrix products are
    ``factor`` (tokens × DP) by (DP × DP) products per token of their first tensor (B, h, L, d);
    the elementwise work is not counted, as for any operation. The products are float32 whatever
    the inputs' dtype (the default ``'ieee'`` precision: FMA loops, not the tensor cores), so
    the counters' roofline takes them at the float32 rate."""
    def formula_of(factor):
        def formula(x_shape, *args, **kwargs):  # tensors come as their shapes
            B, h, L, d = x_shape
            return 2 * factor * B * h * L * _padded(d) ** 2
        return formula

    for name, factor in factors.items():
        op = getattr(torch.ops.linattn_mm, name)
        register_flop_formula(op)(formula_of(factor))
        register_compute_dtype(op, torch.float32)


register_dot_flops({'pola_triton_keys': 2, 'pola_triton_queries': 2,
                    'pola_triton_query_grads': 6, 'pola_triton_key_grads': 4})


class PolarityAttentionTriton(torch.autograd.Function):
    """The Triton core with its Triton backward (passes 1-4 of the module docstring). Inputs:
    q (B, h, N, d), k, v (B, h, n, d) (any strides; float32, bfloat16 or float16), p and
    inv_scale (broadcastable to (1, h, 1, d); inv_scale = 1 / temperature or None), eps, k_bias
    (broadcastable to k, or None), out_dtype, block_n, block_m. Keeps for backward q, k, v and
    k_bias as they came and the (B·h, 2, DP, DP) state ``[W+, W-]`` with the key means; q, k, v
    and k_bias get their gradients in their own dtypes, p and inv_scale in theirs. On ``meta``
    tensors the launches only make their outputs (shapes, for the counters)."""

    @staticmethod
    def forward(ctx, q, k, v, p, eps, inv_scale, k_bias, out_dtype, block_n, block_m):
        B, h, N, n, d = check_qkv('polarity_attention_triton', q, k, v, meta=True)
        dev, DP = q.device, _padded(d)
        pf = _per_head(p, h, d, 'p').to(dev)
        inv_s = None if inv_scale is None else _per_head(inv_scale, h, d, 'temperature').to(dev)
        pe = _expand_bias(k_bias, (B, h, n, d))
        ctx.blocks = (block_n, block_m)  # as given: the backward's default blocks are its own
        block_n, block_m = core_blocks(d, 'forward', block_n, block_m)
        kv, ks = torch.ops.linattn_mm.pola_triton_keys(k, v, pe, pf, inv_s, block_n)
        kv = kv.sum(1).mul_(1.0 / n)  # (B*h, 2, DP, DP): [k+ᵀv, k-ᵀv] / n
        ks = ks.sum(1).mul_(1.0 / n)  # key means
        # columns [0, d_s) take the same-signed stream, the rest the opposite one:
        # W+ = [k+ᵀv | k-ᵀv], W- = [k-ᵀv | k+ᵀv] column-wise
        same = _same_columns(d, DP, dev)
        w = torch.stack([torch.where(same, kv[:, 0], kv[:, 1]),
                         torch.where(same, kv[:, 1], kv[:, 0])], dim=1)
        out = torch.ops.linattn_mm.pola_triton_queries(q, w, ks, pf, inv_s, float(eps), block_m,
                                                       out_dtype or v.dtype)
        ctx.save_for_backward(q, k, v, k_bias, pf, inv_s, w, ks)
        ctx.eps = float(eps)
        ctx.p_meta = (p.shape, p.dtype)
        ctx.inv_meta = None if inv_scale is None else (inv_scale.shape, inv_scale.dtype)
        return out.transpose(1, 2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_without_autocast
    def backward(ctx, grad):
        q, k, v, k_bias, pf, inv_s, w, ks = ctx.saved_tensors
        need = ctx.needs_input_grad
        B, h, N, d = q.shape
        n = k.shape[2]
        DP = w.shape[-1]
        block_n, block_m = core_blocks(d, 'backward', *ctx.blocks)
        # 3. queries: dq, and the partial sums of dW+, dW-, of the key means' gradient, of the
        # inverse temperature's and of the exponents'
        dq, dw, dm, d_inv_q, d_pow_q = torch.ops.linattn_mm.pola_triton_query_grads(
            q, grad, w, ks, pf, inv_s, ctx.eps, block_m)
        dw, dm = dw.sum(1), dm.sum(1).mul_(1.0 / n)  # dm: of the key sums
        # back from [W+, W-] to [k+ᵀv, k-ᵀv] (each sits in the same columns of one and the
        # opposite columns of the other), with their 1 / n
        same = _same_columns(d, DP, q.device)
        dkv = torch.stack([torch.where(same, dw[:, 0], dw[:, 1]),
                           torch.where(same, dw[:, 1], dw[:, 0])], dim=1).mul_(1.0 / n)
        # 4. keys: dk (the gradient of k + k_bias; float32 where the bias's is summed from it),
        # dv
        bias_grad = k_bias is not None and need[6]
        dk, dv, d_inv_k, d_pow_k = torch.ops.linattn_mm.pola_triton_key_grads(
            k, v, _expand_bias(k_bias, (B, h, n, d)), pf, inv_s, dkv, dm, need[1] or bias_grad,
            need[2], torch.float32 if bias_grad else k.dtype, block_n)

        def per_param(q_part, k_part, meta, scale=1.0):
            total = q_part.sum(1).add_(k_part.sum(1)).view(B, h, DP)[..., :d].sum(0)
            shape, dtype = meta
            return total.mul_(scale).view(1, h, 1, d).sum_to_size(shape).to(dtype)

        d_p = per_param(d_pow_q, d_pow_k, ctx.p_meta, _LN2) if need[3] else None
        d_inv = per_param(d_inv_q, d_inv_k, ctx.inv_meta) if inv_s is not None and need[5] \
            else None
        dk = dk.transpose(1, 2) if need[1] or bias_grad else None
        d_bias = dk.sum_to_size(k_bias.shape).to(k_bias.dtype) if bias_grad else None
        return (dq.transpose(1, 2) if need[0] else None, dk.to(k.dtype) if need[1] else None,
                dv.transpose(1, 2) if need[2] else None, d_p, None, d_inv, d_bias, None, None,
                None)


def _expand_bias(k_bias, shape, fn='polarity_attention_triton'):
    """``k_bias`` expanded to (B, h, n, d), or None (errors named by the core function ``fn``)."""
    if k_bias is None:
        return None
    try:
        return k_bias.expand(shape)
    except RuntimeError as e:
        raise ValueError(f'{fn}: k_bias of shape {tuple(k_bias.shape)} does not broadcast to '
                         f'{shape}') from e


def polarity_attention_triton(q, k, v, p, eps=1e-6, temperature=None, k_bias=None,
                              out_dtype=None, block_n=None, block_m=None):
    """Polarity-aware linear attention with the Triton kernels (see the module docstring), with
    gradients through :class:`PolarityAttentionTriton` when autograd asks for them.

    Args:
        q (Tensor): queries (B, h, N, d), any strides.
        k (Tensor): keys (B, h, n, d).
        v (Tensor): values (B, h, n, d).
        p (Tensor): exponents broadcastable to (1, h, 1, d), all > 0.
        eps (float): added to the (mean-normalised) denominators.
        temperature (Tensor, optional): ``softplus(scale)``, broadcastable to (1, h, 1, d); q and k
            are divided by it.
        k_bias (Tensor, optional): position encoding added to ``k`` first, broadcastable to
            (B, h, n, d).
        out_dtype (torch.dtype, optional): output dtype; default ``v.dtype``.
        block_n, block_m (int, optional): keys and queries a program takes per step (powers of
            two, 16 or more), forward and backward; default by head dim and pass
            (:func:`~linattn_mm.ops.dispatch.core_launch`).

    Returns:
        Tensor: (B, h, N, d), a view of a (B, N, h, d) buffer.
    """
    # q, k, v are checked by the Function
    inv_scale = None if temperature is None else temperature.reciprocal()
    return PolarityAttentionTriton.apply(q, k, v, p, eps, inv_scale, k_bias, out_dtype, block_n,
                                         block_m)
