"""Triton kernels of NaLaFormer's norm-aware linear attention core (official kernel), for CUDA
inference and training.

Same maths as :func:`linattn_mm.ops.nala.fast.nala_attention_fast` (and the reference
:func:`~linattn_mm.ops.nala.reference.nala_attention_reference`), in two passes over the tokens
with the feature maps made in registers, as the Pola kernel (:mod:`linattn_mm.ops.pola.triton`):

1. **Keys** (grid: batch·heads × key chunks). Each program reads its chunk of ``k`` and ``v`` once,
   makes ``c = k^lam`` with the sign kept (``k·k·k`` for ``lam = 3``) and the sign split
   ``k+ = relu(c)``, ``k- = relu(-c)`` in float32, and accumulates ``k±ᵀv`` and the key sums
   ``Σk±``. With the 2-D RoPE it accumulates ``(k±·cos)ᵀv`` and ``(k±·sin)ᵀv`` instead: the
   rotation of channel pairs is linear, so ``Σ_j R(φ_j) v_jᵀ = Σ(φ·cos)vᵀ + rot_rows(Σ(φ·sin)vᵀ)``
   is finished on the small (d × d) matrices by torch between the passes.
2. **Queries** (grid: batch·heads × query blocks). Each program reads a block of ``q``, makes the
   norm-dependent power ``p = lam·(0.5 + tanh(‖q‖))`` and ``|q/‖q‖|^p = exp2(p·(log2|q| −
   log2‖q‖))`` with the sign split, the denominator ``φ_q · mean(φ_k) + eps`` from the unrotated
   features, and the numerator ``(φ_q·cos) M + (φ_q·sin)(−rot_rows(M))`` (four d × d products),
   and writes the normalised result straight into a ``(B, N, h, d)`` buffer.

Inputs may be float32, bfloat16 or float16 (every feature, product and sum is float32); matmuls use
``input_precision='ieee'`` unless :func:`~linattn_mm.ops.dispatch.triton_dot_precision` asks for
the tensor cores, and launches fit their stages to the device, as Pola's. Head dims are padded to a
power of two ≥ 16 inside the kernel (masked loads).

**Training** (:class:`NormAwareAttentionTriton`): the forward keeps q, k, v as they came and the
small matrices; the backward is two more passes that recompute the features in registers (the
formulas of :mod:`linattn_mm.ops.nala.autograd`):

3. **Query gradients** (grid: batch·heads × query chunks). With ``dnum = g / den`` and
   ``dden = -Σ_c dnum_c num_c / den``: the four small matrices' gradients ``(φ±·cos)ᵀdnum``,
   ``(φ±·sin)ᵀdnum`` and the key means' ``Σ dden φ±`` are summed per chunk; ``dφ± = (dnum W±ᵀ)·cos
   + (dnum W'±ᵀ)·sin + dden·mean(φ_k±)``, then through the power with ``G = dφ·a``, ``u = q/‖q‖``:
   ``dq = G p / q + u (dp·lam (1 - tanh²‖q‖) - p ΣG / ‖q‖)``, ``dp = ln 2 Σ G (log2|q| - log2‖q‖)``.
4. **Key gradients** (grid: batch·heads × key chunks). The gradient of ``M`` goes back through
   ``rot_rows`` on the small matrices (torch, between the passes: ``dA_cos = dM``, ``dA_sin =
   -rot_rows(dM)``); each program then writes ``dv = (k±·cos) dA_cos± + (k±·sin) dA_sin±`` and
   ``dk = (dk+ [c > 0] - dk- [c < 0]) lam |k|^(lam - 1)`` with ``dk± = (v dA_cos±ᵀ)·cos + (v
   dA_sin±ᵀ)·sin + d mean(φ_k±) / n``.

The launches are torch operators (``torch.ops.linattn_mm.nala_triton_*``) with fake forms, so on
``meta`` tensors they make their outputs' shapes and the counters of :mod:`linattn_mm.utils`
count them. Warps and block sizes by head dim and pass as Pola's
(:func:`~linattn_mm.ops.dispatch.core_launch`). ``core='triton'`` on the mixer (inference and
training; CUDA only), which :func:`linattn_mm.deploy.convert` sets for CUDA inference (head dims
up to 32). ``TRITON_INTERPRET=1`` runs the same
kernels on CPU tensors.
"""
from typing import Optional, Tuple

import torch

from ..common import backward_without_autocast, kept_input
from ..dispatch import core_blocks, core_launch, dot_precision, launch_fitted
from ..pola.triton import (_LIB, _padded, _partials, _split, check_qkv, register_dot_flops,
                          triton)
from .fast import _rot_rows

__all__ = ['nala_attention_triton', 'NormAwareAttentionTriton', 'check_power_and_rope']

if triton is not None:
    import triton.language as tl

    from ..pola.triton import _load_tile, _program

    @triton.jit
    def _key_power(y, lam, CUBE: tl.constexpr):
        """``y^lam`` with the sign of ``y`` kept, float32."""
        if CUBE:
            return y * y * y
        a = tl.exp2(lam * tl.log2(tl.abs(y)))  # 0 at y = 0
        return tl.where(y < 0, -a, a)

    @triton.jit
    def _key_features(y, lam, CUBE: tl.constexpr):
        """``c = y^lam`` (sign kept) and its sign split ``relu(c)``, ``relu(-c)`` (exactly)."""
        c = _key_power(y, lam, CUBE)
        kp = tl.maximum(c, 0.0)
        return c, kp, kp - c

    @triton.jit
    def _rope_tile(SIN, COS, rows, rd, s_rn, s_rd, mask):
        """The RoPE tables' (cos, sin) for the tile ``[rows, rd]``, float32 (zero outside
        ``mask``)."""
        r = rows[:, None] * s_rn + rd[None, :] * s_rd
        return (tl.load(COS + r, mask=mask, other=0.0).to(tl.float32),
                tl.load(SIN + r, mask=mask, other=0.0).to(tl.float32))

    @triton.jit
    def _nala_keys_kernel(K, V, SIN, COS, ACC, KS, n, h, chunk, lam,
                          s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd, s_rn, s_rd,
                          D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr,
                          HAS_ROPE: tl.constexpr, CUBE: tl.constexpr, PREC: tl.constexpr):
        bh, split, b, head, rd, dmask = _program(h, D, DP)
        acc_pc = tl.zeros((DP, DP), dtype=tl.float32)  # (k+ [* cos])^T v
        acc_nc = tl.zeros((DP, DP), dtype=tl.float32)  # (k- [* cos])^T v
        acc_ps = tl.zeros((DP, DP), dtype=tl.float32)  # (k+ * sin)^T v (RoPE only)
        acc_ns = tl.zeros((DP, DP), dtype=tl.float32)
        sum_pos = tl.zeros((DP, ), dtype=tl.float32)
        sum_neg = tl.zeros((DP, ), dtype=tl.float32)
        start = split * chunk
        for off in range(0, chunk, BLOCK_N):
            rn = start + off + tl.arange(0, BLOCK_N)
            m = (rn < n)[:, None] & dmask[None, :]
            y = _load_tile(K, b, head, rn, rd, s_kb, s_kh, s_kn, s_kd, m)
            _, kp, kn = _key_features(y, lam, CUBE)
            v = _load_tile(V, b, head, rn, rd, s_vb, s_vh, s_vn, s_vd, m)
            sum_pos += tl.sum(kp, axis=0)
            sum_neg += tl.sum(kn, axis=0)
            if HAS_ROPE:
                cs, sn = _rope_tile(SIN, COS, rn, rd, s_rn, s_rd, m)
                acc_pc += tl.dot(tl.trans(kp * cs), v, input_precision=PREC)
                acc_nc += tl.dot(tl.trans(kn * cs), v, input_precision=PREC)
                acc_ps += tl.dot(tl.trans(kp * sn), v, input_precision=PREC)
                acc_ns += tl.dot(tl.trans(kn * sn), v, input_precision=PREC)
            else:
                acc_pc += tl.dot(tl.trans(kp), v, input_precision=PREC)
                acc_nc += tl.dot(tl.trans(kn), v, input_precision=PREC)
        # partial sums of this chunk: ACC (B*h, splits, 4, DP, DP), KS (B*h, splits, 2, DP)
        n_split = tl.num_programs(1)
        acc = ACC + (bh * n_split + split) * 4 * DP * DP + rd[:, None] * DP + rd[None, :]
        tl.store(acc, acc_pc)
        tl.store(acc + DP * DP, acc_nc)
        tl.store(acc + 2 * DP * DP, acc_ps)
        tl.store(acc + 3 * DP * DP, acc_ns)
        ks = KS + (bh * n_split + split) * 2 * DP + rd
        tl.store(ks, sum_pos)
        tl.store(ks + DP, sum_neg)

    @triton.jit
    def _nala_queries_kernel(Q, W, KM, SIN, COS, O, N, h, lam, eps,
                             s_qb, s_qh, s_qn, s_qd, s_ob, s_on, s_oh, s_od, s_rn, s_rd,
                             D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                             HAS_ROPE: tl.constexpr, PREC: tl.constexpr):
        bh = tl.program_id(0)
        b = bh // h
        head = bh % h
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rd = tl.arange(0, DP)
        dmask = rd < D
        m = (rm < N)[:, None] & dmask[None, :]
        y = _load_tile(Q, b, head, rm, rd, s_qb, s_qh, s_qn, s_qd, m)
        qn = tl.sqrt(tl.sum(y * y, axis=1))
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * qn) + 1.0)  # qn >= 0; exp overflow -> tanh = 1
        p = lam * (0.5 + tanh)
        lq = tl.log2(tl.maximum(qn, 1e-12))
        a = tl.exp2(p[:, None] * (tl.log2(tl.abs(y)) - lq[:, None]))  # |q / ||q|| |^p; 0 -> 0
        pos = tl.where(y > 0, a, 0.0)
        neg = tl.where(y < 0, a, 0.0)
        km_pos = tl.load(KM + bh * 2 * DP + rd)  # key feature means, zero on the padding
        km_neg = tl.load(KM + bh * 2 * DP + DP + rd)
        den = tl.sum(pos * km_pos[None, :] + neg * km_neg[None, :], axis=1) + eps
        w = W + bh * 4 * DP * DP + rd[:, None] * DP + rd[None, :]
        if HAS_ROPE:
            cs, sn = _rope_tile(SIN, COS, rm, rd, s_rn, s_rd, m)
            num = tl.dot(pos * cs, tl.load(w), input_precision=PREC)
            num += tl.dot(neg * cs, tl.load(w + DP * DP), input_precision=PREC)
            num += tl.dot(pos * sn, tl.load(w + 2 * DP * DP), input_precision=PREC)
            num += tl.dot(neg * sn, tl.load(w + 3 * DP * DP), input_precision=PREC)
        else:
            num = tl.dot(pos, tl.load(w), input_precision=PREC)
            num += tl.dot(neg, tl.load(w + DP * DP), input_precision=PREC)
        out = num / den[:, None]
        tl.store(O + b * s_ob + rm[:, None] * s_on + head * s_oh + rd[None, :] * s_od,
                 out.to(O.dtype.element_ty), mask=m)

    @triton.jit
    def _query_terms(y, lam):
        """Per row of a float32 tile: ``‖q‖`` (clamped at 1e-12), ``1 - tanh²(‖q‖)``, the power
        ``p = lam (0.5 + tanh)``, ``log2|q| - log2‖q‖`` and ``a = |q / ‖q‖|^p``.

        With ``r = 1 / (exp(2‖q‖) + 1)``: ``tanh = 1 - 2r`` (the forward kernel's) and
        ``1 - tanh² = 4r (1 - r)``, within 1e-7 of the exact value, relative, at every norm;
        ``1 - tanh * tanh`` loses its digits where ``tanh`` nears 1 (in float32, 3.8e-6 off at
        ``‖q‖ = 3``, 1.5e-4 at 5, 6 % at 8). The torch core takes ``cosh⁻²``. ``exp``
        overflows to inf for large norms: ``r = 0``, ``tanh = 1``."""
        qn = tl.maximum(tl.sqrt(tl.sum(y * y, axis=1)), 1e-12)
        r = 1.0 / (tl.exp(2.0 * qn) + 1.0)
        p = lam * (0.5 + (1.0 - 2.0 * r))
        lu = tl.log2(tl.abs(y)) - tl.log2(qn)[:, None]
        return qn, 4.0 * r * (1.0 - r), p, lu, tl.exp2(p[:, None] * lu)

    @triton.jit
    def _query_input_grad(y, qn, sech2, p, lu, a, dpos, dneg, lam):
        """The gradient of a query tile ``y`` from those of its features ``relu(c)``,
        ``relu(-c)`` (``dpos``, ``dneg``), with :func:`_query_terms`'s terms (``sech2`` is
        ``1 - tanh²(‖q‖)``): through ``|q / ||q|| |^p`` and the norm in ``p``, 0 at a zero
        element."""
        # G = da a; with u = q / ||q||, du u = G p per channel, and
        # dq = (du - u (du . u)) / ||q|| + dp lam (1 - tanh^2) u,  dp = ln 2 sum G log2|u|
        nz = y != 0
        ga = tl.where(y > 0, dpos, tl.where(y < 0, dneg, 0.0)) * a
        dp = tl.sum(tl.where(nz, ga * lu, 0.0), axis=1) * 0.6931471805599453
        dqn = dp * lam * sech2
        u = y / qn[:, None]
        return tl.where(nz, ga * p[:, None] / y, 0.0) + \
            u * ((dqn - p * tl.sum(ga, axis=1) / qn)[:, None])

    @triton.jit
    def _key_input_grad(y, kc, dkp, dkn, lam, CUBE: tl.constexpr):
        """The gradient of a key tile ``y`` (``kc = y^lam``) from those of its features
        ``relu(kc)``, ``relu(-kc)`` (``dkp``, ``dkn``)."""
        dc = tl.where(kc > 0, dkp, tl.where(kc < 0, -dkn, 0.0))
        if CUBE:
            return dc * 3.0 * y * y
        # d(sign(y) |y|^lam) = lam |y|^(lam - 1)
        return tl.where(y != 0, dc * lam * tl.exp2((lam - 1.0) * tl.log2(tl.abs(y))), 0.0)

    @triton.jit
    def _nala_query_grad_kernel(Q, G, W, KM, SIN, COS, DQ, DW, DKM, N, h, chunk, lam, eps,
                                s_qb, s_qh, s_qn, s_qd, s_gb, s_gh, s_gn, s_gd,
                                s_db, s_dh, s_dn, s_dd, s_rn, s_rd,
                                D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                                HAS_ROPE: tl.constexpr, PREC: tl.constexpr):
        bh, split, b, head, rd, dmask = _program(h, D, DP)
        w = W + bh * 4 * DP * DP + rd[:, None] * DP + rd[None, :]
        w0 = tl.load(w)
        w1 = tl.load(w + DP * DP)
        km_pos = tl.load(KM + bh * 2 * DP + rd)
        km_neg = tl.load(KM + bh * 2 * DP + DP + rd)
        dw0 = tl.zeros((DP, DP), dtype=tl.float32)
        dw1 = tl.zeros((DP, DP), dtype=tl.float32)
        dkm_pos = tl.zeros((DP, ), dtype=tl.float32)
        dkm_neg = tl.zeros((DP, ), dtype=tl.float32)
        if HAS_ROPE:
            w2 = tl.load(w + 2 * DP * DP)
            w3 = tl.load(w + 3 * DP * DP)
            dw2 = tl.zeros((DP, DP), dtype=tl.float32)
            dw3 = tl.zeros((DP, DP), dtype=tl.float32)
        start = split * chunk
        for off in range(0, chunk, BLOCK_M):
            rm = start + off + tl.arange(0, BLOCK_M)
            m = (rm < N)[:, None] & dmask[None, :]
            y = _load_tile(Q, b, head, rm, rd, s_qb, s_qh, s_qn, s_qd, m)
            qn, sech2, p, lu, a = _query_terms(y, lam)
            pos = tl.where(y > 0, a, 0.0)
            neg = tl.where(y < 0, a, 0.0)
            den = tl.sum(pos * km_pos[None, :] + neg * km_neg[None, :], axis=1) + eps
            if HAS_ROPE:
                cs, sn = _rope_tile(SIN, COS, rm, rd, s_rn, s_rd, m)
                pc, nc, ps, ns = pos * cs, neg * cs, pos * sn, neg * sn
                num = tl.dot(pc, w0, input_precision=PREC)
                num += tl.dot(nc, w1, input_precision=PREC)
                num += tl.dot(ps, w2, input_precision=PREC)
                num += tl.dot(ns, w3, input_precision=PREC)
            else:
                num = tl.dot(pos, w0, input_precision=PREC)
                num += tl.dot(neg, w1, input_precision=PREC)
            g = _load_tile(G, b, head, rm, rd, s_gb, s_gh, s_gn, s_gd, m)
            dnum = g / den[:, None]
            dden = -tl.sum(dnum * num, axis=1) / den
            dkm_pos += tl.sum(pos * dden[:, None], axis=0)
            dkm_neg += tl.sum(neg * dden[:, None], axis=0)
            dpos = dden[:, None] * km_pos[None, :]
            dneg = dden[:, None] * km_neg[None, :]
            if HAS_ROPE:
                dw0 += tl.dot(tl.trans(pc), dnum, input_precision=PREC)
                dw1 += tl.dot(tl.trans(nc), dnum, input_precision=PREC)
                dw2 += tl.dot(tl.trans(ps), dnum, input_precision=PREC)
                dw3 += tl.dot(tl.trans(ns), dnum, input_precision=PREC)
                dpos += tl.dot(dnum, tl.trans(w0), input_precision=PREC) * cs + \
                    tl.dot(dnum, tl.trans(w2), input_precision=PREC) * sn
                dneg += tl.dot(dnum, tl.trans(w1), input_precision=PREC) * cs + \
                    tl.dot(dnum, tl.trans(w3), input_precision=PREC) * sn
            else:
                dw0 += tl.dot(tl.trans(pos), dnum, input_precision=PREC)
                dw1 += tl.dot(tl.trans(neg), dnum, input_precision=PREC)
                dpos += tl.dot(dnum, tl.trans(w0), input_precision=PREC)
                dneg += tl.dot(dnum, tl.trans(w1), input_precision=PREC)
            dq = _query_input_grad(y, qn, sech2, p, lu, a, dpos, dneg, lam)
            tl.store(DQ + b * s_db + head * s_dh + rm[:, None] * s_dn + rd[None, :] * s_dd,
                     dq.to(DQ.dtype.element_ty), mask=m)
        part = bh * tl.num_programs(1) + split
        dw = DW + part * 4 * DP * DP + rd[:, None] * DP + rd[None, :]
        tl.store(dw, dw0)
        tl.store(dw + DP * DP, dw1)
        if HAS_ROPE:
            tl.store(dw + 2 * DP * DP, dw2)
            tl.store(dw + 3 * DP * DP, dw3)
        tl.store(DKM + part * 2 * DP + rd, dkm_pos)
        tl.store(DKM + part * 2 * DP + DP + rd, dkm_neg)

    @triton.jit
    def _nala_key_grad_kernel(K, V, SIN, COS, C, DKS, DK, DV, n, h, chunk, lam,
                              s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                              s_dkb, s_dkh, s_dkn, s_dkd, s_dvb, s_dvh, s_dvn, s_dvd, s_rn, s_rd,
                              D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr,
                              HAS_ROPE: tl.constexpr, CUBE: tl.constexpr,
                              WANT_DK: tl.constexpr, WANT_DV: tl.constexpr, PREC: tl.constexpr):
        bh, split, b, head, rd, dmask = _program(h, D, DP)
        c = C + bh * 4 * DP * DP + rd[:, None] * DP + rd[None, :]
        c_pos = tl.load(c)  # gradients of the key-side sums (the 1 / n included)
        c_neg = tl.load(c + DP * DP)
        if HAS_ROPE:
            s_pos = tl.load(c + 2 * DP * DP)
            s_neg = tl.load(c + 3 * DP * DP)
        dks_pos = tl.load(DKS + bh * 2 * DP + rd)
        dks_neg = tl.load(DKS + bh * 2 * DP + DP + rd)
        start = split * chunk
        for off in range(0, chunk, BLOCK_N):
            rn = start + off + tl.arange(0, BLOCK_N)
            m = (rn < n)[:, None] & dmask[None, :]
            y = _load_tile(K, b, head, rn, rd, s_kb, s_kh, s_kn, s_kd, m)
            kc, kp, kn = _key_features(y, lam, CUBE)
            v = _load_tile(V, b, head, rn, rd, s_vb, s_vh, s_vn, s_vd, m)
            if HAS_ROPE:
                cs, sn = _rope_tile(SIN, COS, rn, rd, s_rn, s_rd, m)
                if WANT_DV:
                    dv = tl.dot(kp * cs, c_pos, input_precision=PREC)
                    dv += tl.dot(kn * cs, c_neg, input_precision=PREC)
                    dv += tl.dot(kp * sn, s_pos, input_precision=PREC)
                    dv += tl.dot(kn * sn, s_neg, input_precision=PREC)
                dkp = tl.dot(v, tl.trans(c_pos), input_precision=PREC) * cs + \
                    tl.dot(v, tl.trans(s_pos), input_precision=PREC) * sn
                dkn = tl.dot(v, tl.trans(c_neg), input_precision=PREC) * cs + \
                    tl.dot(v, tl.trans(s_neg), input_precision=PREC) * sn
            else:
                if WANT_DV:
                    dv = tl.dot(kp, c_pos, input_precision=PREC)
                    dv += tl.dot(kn, c_neg, input_precision=PREC)
                dkp = tl.dot(v, tl.trans(c_pos), input_precision=PREC)
                dkn = tl.dot(v, tl.trans(c_neg), input_precision=PREC)
            if WANT_DV:
                tl.store(DV + b * s_dvb + head * s_dvh + rn[:, None] * s_dvn + rd[None, :] * s_dvd,
                         dv.to(DV.dtype.element_ty), mask=m)
            if WANT_DK:
                dk = _key_input_grad(y, kc, dkp + dks_pos[None, :], dkn + dks_neg[None, :], lam,
                                     CUBE)
                tl.store(DK + b * s_dkb + head * s_dkh + rn[:, None] * s_dkn + rd[None, :] * s_dkd,
                         dk.to(DK.dtype.element_ty), mask=m)


# ------------------------------------------------------------------------------------------------
# The four launches as operators (``torch.ops.linattn_mm.nala_triton_*``, as Pola's): one
# operation each, with fake forms for ``meta`` tensors.
# ------------------------------------------------------------------------------------------------


def _keys_outputs(k, block_n):
    B, h, n, d = k.shape
    DP = _padded(d)
    splits, chunk = _split(n, B * h, block_n, k.device)
    return (_partials(B * h, splits, k.device, 4, DP, DP),
            _partials(B * h, splits, k.device, 2, DP)), chunk


def _rope_args(sin, cos, fallback):
    if sin is None:
        return fallback, fallback, (0, 0)
    return sin, cos, cos.stride()


@torch.library.custom_op(_LIB + 'nala_triton_keys', mutates_args=())
def _keys_op(k: torch.Tensor, v: torch.Tensor, sin: Optional[torch.Tensor],
             cos: Optional[torch.Tensor], lam: float,
             block_n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pass 1: per key chunk, the partial sums ``(k±[·cos])ᵀv``, ``(k±·sin)ᵀv`` (B·h, splits, 4,
    DP, DP) and ``Σk±`` (B·h, splits, 2, DP)."""
    B, h, n, d = k.shape
    (acc, ks), chunk = _keys_outputs(k, block_n)
    sin_t, cos_t, rs = _rope_args(sin, cos, k)
    DP = _padded(d)
    launch_fitted(_nala_keys_kernel, (B * h, acc.shape[1]),
        k, v, sin_t, cos_t, acc, ks, n, h, chunk, lam, *k.stride(), *v.stride(), *rs,
        PREC=dot_precision(), D=d, DP=DP,
        BLOCK_N=block_n, HAS_ROPE=sin is not None, CUBE=lam == 3.0,
        num_warps=core_launch(d)[0])
    return acc, ks


@_keys_op.register_fake
def _(k, v, sin, cos, lam, block_n):
    return _keys_outputs(k, block_n)[0]


@torch.library.custom_op(_LIB + 'nala_triton_queries', mutates_args=())
def _queries_op(q: torch.Tensor, w: torch.Tensor, km: torch.Tensor, sin: Optional[torch.Tensor],
                cos: Optional[torch.Tensor], lam: float, eps: float, block_m: int,
                out_dtype: torch.dtype) -> torch.Tensor:
    """Pass 2: the normalised output, a (B, N, h, d) buffer."""
    B, h, N, d = q.shape
    out = q.new_empty(B, N, h, d, dtype=out_dtype)
    sin_t, cos_t, rs = _rope_args(sin, cos, q)
    launch_fitted(_nala_queries_kernel, (B * h, triton.cdiv(N, block_m)),
        q, w, km, sin_t, cos_t, out, N, h, lam, eps, *q.stride(), *out.stride(), *rs,
        PREC=dot_precision(), D=d, DP=_padded(d), BLOCK_M=block_m, HAS_ROPE=sin is not None,
        num_warps=core_launch(d)[0])
    return out


@_queries_op.register_fake
def _(q, w, km, sin, cos, lam, eps, block_m, out_dtype):
    B, h, N, d = q.shape
    return q.new_empty(B, N, h, d, dtype=out_dtype)


def _query_grad_outputs(q, block_m):
    B, h, N, d = q.shape
    DP = _padded(d)
    splits, chunk = _split(N, B * h, block_m, q.device)
    return (q.new_empty(B, N, h, d), _partials(B * h, splits, q.device, 4, DP, DP),
            _partials(B * h, splits, q.device, 2, DP)), chunk


@torch.library.custom_op(_LIB + 'nala_triton_query_grads', mutates_args=())
def _query_grads_op(q: torch.Tensor, grad: torch.Tensor, w: torch.Tensor, km: torch.Tensor,
                    sin: Optional[torch.Tensor], cos: Optional[torch.Tensor], lam: float,
                    eps: float, block_m: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 3: dq (a (B, N, h, d) buffer in q's dtype) and per query chunk the partial sums of the
    gradients of the four query-side matrices and of the key feature means."""
    B, h, N, d = q.shape
    (dq, dw, dkm), chunk = _query_grad_outputs(q, block_m)
    if sin is None:
        dw[:, :, 2:].zero_()  # the RoPE's two matrices: none
    dq_t = dq.transpose(1, 2)
    sin_t, cos_t, rs = _rope_args(sin, cos, q)
    DP = _padded(d)
    launch_fitted(_nala_query_grad_kernel, (B * h, dw.shape[1]),
        q, grad, w, km, sin_t, cos_t, dq_t, dw, dkm, N, h, chunk, lam, eps, *q.stride(),
        *grad.stride(), *dq_t.stride(), *rs, PREC=dot_precision(), D=d, DP=DP, BLOCK_M=block_m,
        HAS_ROPE=sin is not None, num_warps=core_launch(d, 'backward')[0])
    return dq, dw, dkm


@_query_grads_op.register_fake
def _(q, grad, w, km, sin, cos, lam, eps, block_m):
    return _query_grad_outputs(q, block_m)[0]


def _key_grad_outputs(k, want_dk, want_dv, dv_dtype):
    B, h, n, d = k.shape
    return (k.new_empty((B, n, h, d) if want_dk else (0, )),
            k.new_empty((B, n, h, d) if want_dv else (0, ), dtype=dv_dtype))


@torch.library.custom_op(_LIB + 'nala_triton_key_grads', mutates_args=())
def _key_grads_op(k: torch.Tensor, v: torch.Tensor, sin: Optional[torch.Tensor],
                  cos: Optional[torch.Tensor], c: torch.Tensor, dks: torch.Tensor, lam: float,
                  want_dk: bool, want_dv: bool, block_n: int,
                  dv_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pass 4: dk (in k's dtype) and dv (in ``dv_dtype``), (B, n, h, d) buffers (empty where not
    wanted), from the gradients of the key-side sums ``c`` (B·h, 4, DP, DP) and of the key
    feature sums ``dks`` (B·h, 2, DP)."""
    B, h, n, d = k.shape
    dk, dv = _key_grad_outputs(k, want_dk, want_dv, dv_dtype)
    dk_t = dk.transpose(1, 2) if want_dk else k
    dv_t = dv.transpose(1, 2) if want_dv else v
    sin_t, cos_t, rs = _rope_args(sin, cos, k)
    splits, chunk = _split(n, B * h, block_n, k.device)
    DP = _padded(d)
    launch_fitted(_nala_key_grad_kernel, (B * h, splits),
        k, v, sin_t, cos_t, c, dks, dk, dv, n, h, chunk, lam, *k.stride(), *v.stride(),
        *dk_t.stride(), *dv_t.stride(), *rs, PREC=dot_precision(), D=d, DP=DP, BLOCK_N=block_n,
        HAS_ROPE=sin is not None, CUBE=lam == 3.0, WANT_DK=want_dk, WANT_DV=want_dv,
        num_warps=core_launch(d, 'backward')[0])
    return dk, dv


@_key_grads_op.register_fake
def _(k, v, sin, cos, c, dks, lam, want_dk, want_dv, block_n, dv_dtype):
    return _key_grad_outputs(k, want_dk, want_dv, dv_dtype)


register_dot_flops({'nala_triton_keys': 4, 'nala_triton_queries': 4,  # with the RoPE
                    'nala_triton_query_grads': 12, 'nala_triton_key_grads': 8})


class NormAwareAttentionTriton(torch.autograd.Function):
    """The Triton NaLa core (official kernel) with its Triton backward: passes 1-2 of the module
    docstring forward; the backward recomputes the features in registers in two more passes
    (3: queries: ``dq`` and the gradients of the four query-side matrices and of the key means;
    4: keys: ``dk``, ``dv``). Keeps q, k, v as they came (v: ``v_keep``, see below) and the
    small per-head matrices; q, k, v get their gradients in their own dtypes. Inputs: q, k, v
    (B, h, N, d), lam, eps, sin, cos ((N, d) or None), out_dtype, block_n, block_m, v_keep (None,
    or a lower-precision twin of v with ``v_keep.to(v.dtype) == v``, the projection v was cast
    from: the kernels read it instead, the same values in fewer bytes, and it is what is kept)."""

    @staticmethod
    def forward(ctx, q, k, v, lam, eps, sin, cos, out_dtype, block_n, block_m, v_keep=None):
        fn = 'nala_attention_triton'
        v_in = kept_input(fn, v, v_keep)
        B, h, N, n, d = check_qkv(fn, q, k, v, meta=True)
        if v_keep is not None:
            check_qkv(fn, q, k, v_in, meta=True)
        DP = _padded(d)
        blocks = (block_n, block_m)  # as given: the backward's default blocks are its own
        block_n, block_m = core_blocks(d, 'forward', block_n, block_m)
        acc, ks = torch.ops.linattn_mm.nala_triton_keys(k, v_in, sin, cos, lam, block_n)
        acc = acc.sum(1).mul_(1.0 / n)  # (B*h, 4, DP, DP)
        km = ks.sum(1).mul_(1.0 / n)  # key feature means (B*h, 2, DP)
        if sin is not None:
            # M = sum_j R(phi_j) v_j^T / n per sign half; the queries meet [M+, M-, -rot(M+),
            # -rot(M-)] (rows pair up within each half: d is even and the padding rows are zero)
            mat = acc[:, :2] + _rot_rows(acc[:, 2:])
            w = torch.cat([mat, -_rot_rows(mat)], dim=1)
        else:
            w = acc
        out = torch.ops.linattn_mm.nala_triton_queries(q, w, km, sin, cos, lam, eps, block_m,
                                                       out_dtype or v.dtype)
        ctx.save_for_backward(q, k, v_in, sin, cos, w, km)
        ctx.args = (lam, eps, blocks, DP, v.dtype)
        return out.transpose(1, 2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_without_autocast
    def backward(ctx, grad):
        q, k, v, sin, cos, w, km = ctx.saved_tensors
        lam, eps, blocks, DP, v_dtype = ctx.args
        need = ctx.needs_input_grad
        n = k.shape[2]
        block_n, block_m = core_blocks(q.shape[-1], 'backward', *blocks)
        dq, dw, dkm = torch.ops.linattn_mm.nala_triton_query_grads(q, grad, w, km, sin, cos, lam,
                                                                   eps, block_m)
        dw, dkm = dw.sum(1), dkm.sum(1).mul_(1.0 / n)  # dkm: of the key feature sums
        if sin is not None:
            # W = [M, -rot(M)] -> dM = dW[:2] + rot(dW[2:]) (rot^T = -rot); M = A_cos +
            # rot(A_sin) -> dA_cos = dM, dA_sin = -rot(dM); the sums' 1 / n
            dm = dw[:, :2] + _rot_rows(dw[:, 2:])
            c = torch.cat([dm, -_rot_rows(dm)], dim=1).mul_(1.0 / n)
        else:
            c = dw.mul_(1.0 / n)
        dk, dv = torch.ops.linattn_mm.nala_triton_key_grads(k, v, sin, cos, c, dkm, lam, need[1],
                                                            need[2], block_n, v_dtype)
        return (dq.transpose(1, 2) if need[0] else None, dk.transpose(1, 2) if need[1] else None,
                dv.transpose(1, 2) if need[2] else None, None, None, None, None, None, None,
                None, None)


def nala_attention_triton(q, k, v, power=3., eps=1e-6, sin=None, cos=None, out_dtype=None,
                          block_n=None, block_m=None, v_keep=None):
    """Norm-aware linear attention core (official kernel) with the Triton kernels (see the module
    docstring); same arguments and result as :func:`linattn_mm.ops.nala.fast.nala_attention_fast`.

    Args:
        q (Tensor): queries (B, h, N, d), any strides.
        k (Tensor): keys (B, h, N, d).
        v (Tensor): values (B, h, N, d).
        power (float): ``lam`` (key power, scale of the query power). Default 3.
        eps (float): added to the denominator.
        sin, cos (Tensor, optional): the 2-D RoPE (N, d), channel pairs sharing one angle (as
            :class:`~linattn_mm.models.attentions.nala.RoPE2d` makes them); None: no RoPE.
        out_dtype (torch.dtype, optional): output dtype; default ``v.dtype``.
        v_keep (Tensor, optional): a lower-precision twin of ``v`` (``v_keep.to(v.dtype) == v``,
            the projection v was cast from): read and kept instead of ``v``; ``v`` still gets
            its gradient in its own dtype.
        block_n, block_m (int, optional): keys and queries a program takes per step (powers of
            two, 16 or more), forward and backward; default by head dim and pass
            (:func:`~linattn_mm.ops.dispatch.core_launch`).

    Returns:
        Tensor: (B, h, N, d), a view of a (B, N, h, d) buffer.
    """
    # q, k, v are checked by the Function
    sin, cos = check_power_and_rope('nala_attention_triton', q, k, power, sin, cos)
    return NormAwareAttentionTriton.apply(q, k, v, float(power), float(eps), sin, cos, out_dtype,
                                          block_n, block_m, v_keep)


def check_power_and_rope(fn, q, k, power, sin, cos):
    """``power`` and the RoPE tables of a NaLa core that runs Triton kernels (named ``fn``):
    a positive power, both tables or neither, keys on the query grid, tables of shape (N, d) and
    an even head dim. Returns ``sin, cos`` on q's device with one stride (None, None without the
    RoPE); a ``ValueError`` names what is wrong."""
    if power <= 0:
        raise ValueError(f'{fn}: power must be positive, got {power}')
    if sin is None and cos is None:
        return None, None
    if sin is None or cos is None:
        raise ValueError(f'{fn}: give both sin and cos, or neither')
    N, n, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if n != N or tuple(sin.shape) != (N, d) or tuple(cos.shape) != (N, d):
        raise ValueError(f'{fn}: the RoPE needs keys on the query grid and sin/cos of shape '
                         f'(N, d) = ({N}, {d}); got n={n}, sin {tuple(sin.shape)}, cos '
                         f'{tuple(cos.shape)}')
    if d % 2:
        raise ValueError(f'{fn}: the RoPE rotates channel pairs; head dim {d} is odd')
    sin, cos = sin.to(q.device), cos.to(q.device)
    if cos.stride() != sin.stride():
        sin, cos = sin.contiguous(), cos.contiguous()
    return sin, cos
