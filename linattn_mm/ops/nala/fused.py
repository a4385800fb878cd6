"""The fused training core of NaLaFormer's norm-aware attention (official kernel): the torch
core's products, with its elementwise passes as three Triton kernels (CUDA; ``core='fused'``).

As for Pola (:mod:`linattn_mm.ops.pola.fused`): the torch Function
(:mod:`linattn_mm.ops.nala.autograd`) makes the feature maps, their RoPE and their gradients in
many elementwise passes over full maps, the Triton core (:mod:`linattn_mm.ops.nala.triton`) fuses
the products too and runs them as FMA loops. Here (formulas of :mod:`linattn_mm.ops.nala.autograd`,
per head; ``R`` the RoPE, ``[f cos | f sin]`` with the (N, d) tables over both halves of f):

* **Features** (one launch per map): keys ``ck = k^lam``, ``fk = [relu(ck), relu(-ck)]``, written
  as ``F_k = fk`` or with the RoPE ``[fk cos | fk sin]`` (float32), and per chunk of tokens the
  partial sums of ``fk`` (the key means); queries ``c = sign(q) |q / ||q|| |^p``,
  ``p = lam (0.5 + tanh ||q||)``, ``F_q`` the same way, and the denominators
  ``den = fq . mean(fk) + eps``.
* **Products** in torch (cuBLAS, float32): ``W = F_k^T v / n`` (with the RoPE folded,
  :func:`~linattn_mm.ops.nala.fast.rope_fold`), ``num = F_q W``, ``out = num / den``; backward
  ``dnum = g / den``, ``dden = -(dnum . num) / den``, ``dF_q = dnum W^T``, ``dW = F_q^T dnum``,
  ``dv = F_k dA``, ``dF_k = v dA^T``.
* **Feature gradients** (one launch per map): the RoPE undone (``dF cos + dF' sin``), the
  denominators' term added (queries: ``dden mean(fk)``, and per chunk the partial sums of
  ``dden fq``, the key means' gradient; keys: that gradient / n), then back through the powers
  (queries: through ``|q / ||q|| |^p`` and the norm in ``p``; keys: ``lam |k|^(lam - 1)``);
  dq and dk in the inputs' dtypes.

Kept for backward: q, k, v (``v_keep``, as the torch Function), the RoPE tables, ``W`` and the
key means. The gradients are those of the plain autograd of the reference (tests: float32 to
1e-5 relative). The paper's kernel and a constant ``query_power`` have no fused core (as no
Triton core). CUDA, or CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``); on
``meta`` tensors the launches make their outputs only (the counters see one operation each).
"""
from typing import Optional, Tuple

import torch

from ..common import backward_without_autocast, into, kept_input, no_autocast, token_gram
from ..dispatch import (fused_block, fused_chunks, fused_warps, launch_fitted, padded_head_dims,
                        triton_module)
from ..pola.triton import check_qkv
from .fast import rope_fold
from .triton import _rope_args, check_power_and_rope

triton = triton_module()
if triton is not None:
    import triton.language as tl

    from ..pola.triton import _load_tile, _program
    from .triton import (_key_features, _key_input_grad, _query_input_grad, _query_terms,
                         _rope_tile)

__all__ = ['nala_attention_fused', 'NormAwareAttentionFused']


if triton is not None:

    @triton.jit
    def _store_features(F, bh, rows, rd, m, pos, neg, cs, sn, L,
                        D: tl.constexpr, HAS_ROPE: tl.constexpr):
        """Rows ``rows`` of ``F_x`` (B·h, L, 2D or 4D): ``[pos | neg]``, with the RoPE
        ``[pos cos | neg cos | pos sin | neg sin]``."""
        if HAS_ROPE:
            f = F + (bh * L + rows[:, None]) * (4 * D) + rd[None, :]
            tl.store(f, pos * cs, mask=m)
            tl.store(f + D, neg * cs, mask=m)
            tl.store(f + 2 * D, pos * sn, mask=m)
            tl.store(f + 3 * D, neg * sn, mask=m)
        else:
            f = F + (bh * L + rows[:, None]) * (2 * D) + rd[None, :]
            tl.store(f, pos, mask=m)
            tl.store(f + D, neg, mask=m)

    @triton.jit
    def _load_feature_grads(DF, bh, rows, rd, m, cs, sn, L,
                            D: tl.constexpr, HAS_ROPE: tl.constexpr):
        """The gradients of ``[pos | neg]`` from those of ``F_x`` (the RoPE undone)."""
        if HAS_ROPE:
            df = DF + (bh * L + rows[:, None]) * (4 * D) + rd[None, :]
            dpos = tl.load(df, mask=m, other=0.0) * cs + tl.load(df + 2 * D, mask=m, other=0.0) * sn
            dneg = tl.load(df + D, mask=m, other=0.0) * cs + \
                tl.load(df + 3 * D, mask=m, other=0.0) * sn
        else:
            df = DF + (bh * L + rows[:, None]) * (2 * D) + rd[None, :]
            dpos = tl.load(df, mask=m, other=0.0)
            dneg = tl.load(df + D, mask=m, other=0.0)
        return dpos, dneg

    @triton.jit
    def _nala_fused_features_kernel(X, KM, SIN, COS, F, DEN, PART, L, h, chunk, lam, eps,
                                    s_xb, s_xh, s_xn, s_xd, s_rn, s_rd,
                                    D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                                    QUERIES: tl.constexpr, HAS_ROPE: tl.constexpr,
                                    CUBE: tl.constexpr):
        bh, split, b, head, rd, dmask = _program(h, D, DP)
        if QUERIES:
            km_pos = tl.load(KM + bh * 2 * DP + rd)  # key feature means, zero on the padding
            km_neg = tl.load(KM + bh * 2 * DP + DP + rd)
        else:
            sum_pos = tl.zeros((DP, ), dtype=tl.float32)
            sum_neg = tl.zeros((DP, ), dtype=tl.float32)
        start = split * chunk
        for off in range(0, chunk, BLOCK):
            rows = start + off + tl.arange(0, BLOCK)
            m = (rows < L)[:, None] & dmask[None, :]
            y = _load_tile(X, b, head, rows, rd, s_xb, s_xh, s_xn, s_xd, m)
            if QUERIES:
                _, _, _, _, a = _query_terms(y, lam)
                pos = tl.where(y > 0, a, 0.0)
                neg = tl.where(y < 0, a, 0.0)
                den = tl.sum(pos * km_pos[None, :] + neg * km_neg[None, :], axis=1) + eps
                tl.store(DEN + bh * L + rows, den, mask=rows < L)
            else:
                _, pos, neg = _key_features(y, lam, CUBE)
                sum_pos += tl.sum(pos, axis=0)
                sum_neg += tl.sum(neg, axis=0)
            cs, sn = pos, pos  # unused without the RoPE
            if HAS_ROPE:
                cs, sn = _rope_tile(SIN, COS, rows, rd, s_rn, s_rd, m)
            _store_features(F, bh, rows, rd, m, pos, neg, cs, sn, L, D, HAS_ROPE)
        if not QUERIES:
            part = PART + (bh * tl.num_programs(1) + split) * 2 * DP + rd
            tl.store(part, sum_pos)
            tl.store(part + DP, sum_neg)

    @triton.jit
    def _nala_fused_query_grads_kernel(Q, KM, SIN, COS, DF, DDEN, DQ, DKM, L, h, chunk, lam,
                                       s_qb, s_qh, s_qn, s_qd, s_db, s_dh, s_dn, s_dd, s_rn, s_rd,
                                       D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                                       HAS_ROPE: tl.constexpr):
        bh, split, b, head, rd, dmask = _program(h, D, DP)
        km_pos = tl.load(KM + bh * 2 * DP + rd)
        km_neg = tl.load(KM + bh * 2 * DP + DP + rd)
        dkm_pos = tl.zeros((DP, ), dtype=tl.float32)
        dkm_neg = tl.zeros((DP, ), dtype=tl.float32)
        start = split * chunk
        for off in range(0, chunk, BLOCK):
            rows = start + off + tl.arange(0, BLOCK)
            m = (rows < L)[:, None] & dmask[None, :]
            y = _load_tile(Q, b, head, rows, rd, s_qb, s_qh, s_qn, s_qd, m)
            qn, sech2, p, lu, a = _query_terms(y, lam)
            pos = tl.where(y > 0, a, 0.0)
            neg = tl.where(y < 0, a, 0.0)
            cs, sn = pos, pos  # unused without the RoPE
            if HAS_ROPE:
                cs, sn = _rope_tile(SIN, COS, rows, rd, s_rn, s_rd, m)
            dpos, dneg = _load_feature_grads(DF, bh, rows, rd, m, cs, sn, L, D, HAS_ROPE)
            dden = tl.load(DDEN + bh * L + rows, mask=rows < L, other=0.0)
            dkm_pos += tl.sum(pos * dden[:, None], axis=0)
            dkm_neg += tl.sum(neg * dden[:, None], axis=0)
            dpos += dden[:, None] * km_pos[None, :]
            dneg += dden[:, None] * km_neg[None, :]
            dq = _query_input_grad(y, qn, sech2, p, lu, a, dpos, dneg, lam)
            tl.store(DQ + b * s_db + head * s_dh + rows[:, None] * s_dn + rd[None, :] * s_dd,
                     dq.to(DQ.dtype.element_ty), mask=m)
        part = DKM + (bh * tl.num_programs(1) + split) * 2 * DP + rd
        tl.store(part, dkm_pos)
        tl.store(part + DP, dkm_neg)

    @triton.jit
    def _nala_fused_key_grads_kernel(K, SIN, COS, DF, DKS, DK, L, h, chunk, lam,
                                     s_kb, s_kh, s_kn, s_kd, s_db, s_dh, s_dn, s_dd, s_rn, s_rd,
                                     D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                                     HAS_ROPE: tl.constexpr, CUBE: tl.constexpr):
        bh, split, b, head, rd, dmask = _program(h, D, DP)
        dks_pos = tl.load(DKS + bh * 2 * DP + rd)  # of the key feature sums (the 1 / n included)
        dks_neg = tl.load(DKS + bh * 2 * DP + DP + rd)
        start = split * chunk
        for off in range(0, chunk, BLOCK):
            rows = start + off + tl.arange(0, BLOCK)
            m = (rows < L)[:, None] & dmask[None, :]
            y = _load_tile(K, b, head, rows, rd, s_kb, s_kh, s_kn, s_kd, m)
            kc, _, _ = _key_features(y, lam, CUBE)
            cs, sn = y, y  # unused without the RoPE
            if HAS_ROPE:
                cs, sn = _rope_tile(SIN, COS, rows, rd, s_rn, s_rd, m)
            dkp, dkn = _load_feature_grads(DF, bh, rows, rd, m, cs, sn, L, D, HAS_ROPE)
            dk = _key_input_grad(y, kc, dkp + dks_pos[None, :], dkn + dks_neg[None, :], lam, CUBE)
            tl.store(DK + b * s_db + head * s_dh + rows[:, None] * s_dn + rd[None, :] * s_dd,
                     dk.to(DK.dtype.element_ty), mask=m)


# ------------------------------------------------------------------------------------------------
# The three launches as operators (``torch.ops.linattn_mm.nala_fused_*``), with fake forms (the
# counters of linattn_mm.utils count what each kernel reads and writes on ``meta`` tensors).
# ------------------------------------------------------------------------------------------------
_LIB = 'linattn_mm::'


def _features_outputs(x, rope, queries):
    B, h, L, d = x.shape
    DP = padded_head_dims(d)
    splits, chunk = fused_chunks(L, B * h, fused_block(d), x.device)
    f = torch.empty(B, h, L, (4 if rope else 2) * d, dtype=torch.float32, device=x.device)
    if queries:
        side = torch.empty(B, h, L, dtype=torch.float32, device=x.device)  # denominators
    else:  # partial sums of the key features per chunk
        side = torch.empty(B * h, splits, 2, DP, dtype=torch.float32, device=x.device)
    return (f, side), chunk


@torch.library.custom_op(_LIB + 'nala_fused_features', mutates_args=())
def _features_op(x: torch.Tensor, km: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                 cos: Optional[torch.Tensor], lam: float,
                 eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keys (``km`` None): ``F_k`` (B, h, n, 2d or 4d) and the partial sums of ``fk`` per chunk
    (B·h, chunks, 2, DP). Queries (``km`` the key feature means (B·h, 2, DP)): ``F_q`` and the
    denominators (B, h, N). Float32."""
    B, h, L, d = x.shape
    queries = km is not None
    (f, side), chunk = _features_outputs(x, sin is not None, queries)
    sin_t, cos_t, rs = _rope_args(sin, cos, x)
    splits = fused_chunks(L, B * h, fused_block(d), x.device)[0]
    launch_fitted(_nala_fused_features_kernel, (B * h, splits),
        x, km if queries else x, sin_t, cos_t, f, side, side, L, h, chunk, lam, eps, *x.stride(),
        *rs, num_warps=fused_warps(), D=d, DP=padded_head_dims(d), BLOCK=fused_block(d),
        QUERIES=queries, HAS_ROPE=sin is not None, CUBE=lam == 3.0)
    return f, side


@_features_op.register_fake
def _(x, km, sin, cos, lam, eps):
    return _features_outputs(x, sin is not None, km is not None)[0]


def _query_grads_outputs(q):
    B, h, N, d = q.shape
    splits, chunk = fused_chunks(N, B * h, fused_block(d), q.device)
    return (q.new_empty(B, N, h, d),
            torch.empty(B * h, splits, 2, padded_head_dims(d), dtype=torch.float32,
                        device=q.device)), chunk


@torch.library.custom_op(_LIB + 'nala_fused_query_grads', mutates_args=())
def _query_grads_op(q: torch.Tensor, km: torch.Tensor, sin: Optional[torch.Tensor],
                    cos: Optional[torch.Tensor], df: torch.Tensor, dden: torch.Tensor,
                    lam: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """dq (a (B, N, h, d) buffer in q's dtype) from the gradients of ``F_q`` (contiguous float32)
    and of the denominators (B, h, N); and per chunk the partial sums (B·h, chunks, 2, DP) of
    the key feature means' gradient."""
    B, h, N, d = q.shape
    (dq, dkm), chunk = _query_grads_outputs(q)
    dq_t = dq.transpose(1, 2)
    sin_t, cos_t, rs = _rope_args(sin, cos, q)
    launch_fitted(_nala_fused_query_grads_kernel, (B * h, dkm.shape[1]),
        q, km, sin_t, cos_t, df, dden, dq_t, dkm, N, h, chunk, lam, *q.stride(), *dq_t.stride(),
        *rs, num_warps=fused_warps(), D=d, DP=padded_head_dims(d), BLOCK=fused_block(d),
        HAS_ROPE=sin is not None)
    return dq, dkm


@_query_grads_op.register_fake
def _(q, km, sin, cos, df, dden, lam):
    return _query_grads_outputs(q)[0]


@torch.library.custom_op(_LIB + 'nala_fused_key_grads', mutates_args=())
def _key_grads_op(k: torch.Tensor, sin: Optional[torch.Tensor], cos: Optional[torch.Tensor],
                  df: torch.Tensor, dks: torch.Tensor, lam: float) -> torch.Tensor:
    """dk (a (B, n, h, d) buffer in k's dtype) from the gradients of ``F_k`` (contiguous float32)
    and of the key feature sums ``dks`` (B·h, 2, DP)."""
    B, h, n, d = k.shape
    dk = k.new_empty(B, n, h, d)
    dk_t = dk.transpose(1, 2)
    sin_t, cos_t, rs = _rope_args(sin, cos, k)
    splits, chunk = fused_chunks(n, B * h, fused_block(d), k.device)
    launch_fitted(_nala_fused_key_grads_kernel, (B * h, splits),
        k, sin_t, cos_t, df, dks, dk_t, n, h, chunk, lam, *k.stride(), *dk_t.stride(), *rs,
        num_warps=fused_warps(), D=d, DP=padded_head_dims(d), BLOCK=fused_block(d),
        HAS_ROPE=sin is not None, CUBE=lam == 3.0)
    return dk


@_key_grads_op.register_fake
def _(k, sin, cos, df, dks, lam):
    B, h, n, d = k.shape
    return k.new_empty(B, n, h, d)


class NormAwareAttentionFused(torch.autograd.Function):
    """The fused NaLa core (module docstring). Inputs: q, k, v (B, h, N, d) (any strides;
    float32, bfloat16 or float16), ``lam``, ``eps``, ``sin``, ``cos`` ((N, d) or None),
    ``v_keep`` (None, or a lower-precision twin of ``v`` with ``v_keep.to(v.dtype) == v``,
    read and kept instead, as :class:`~linattn_mm.ops.nala.autograd.NormAwareAttention`). The
    result is float32, a (B, h, N, d) view of a (B, N, h, d) buffer; q, k, v get their gradients
    in their own dtypes."""

    @staticmethod
    def forward(ctx, q, k, v, lam, eps, sin, cos, v_keep=None):
        with no_autocast(q.device):  # float32 products, whatever the caller's autocast
            return NormAwareAttentionFused._forward(ctx, q, k, v, lam, eps, sin, cos, v_keep)

    @staticmethod
    def _forward(ctx, q, k, v, lam, eps, sin, cos, v_keep):
        fn = 'nala_attention_fused'
        v_in = kept_input(fn, v, v_keep)
        B, h, N, n, d = check_qkv(fn, q, k, v_in, meta=True)
        fk, ks = torch.ops.linattn_mm.nala_fused_features(k, None, sin, cos, lam, eps)
        km = ks.sum(1).mul_(1.0 / n)  # key feature means (B·h, 2, DP), zero on the padding
        w = token_gram(fk, v_in.to(torch.float32))
        del fk
        w = w.mul_(1.0 / n) if sin is None else rope_fold(w, n)
        fq, den = torch.ops.linattn_mm.nala_fused_features(q, km, sin, cos, lam, eps)
        out = torch.empty(B, N, h, d, dtype=torch.float32, device=q.device).transpose(1, 2)
        into(torch.div, out, fq @ w, den.unsqueeze(-1))
        ctx.save_for_backward(q, k, v_in, sin, cos, w, km)
        ctx.args = (lam, eps, v.dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_without_autocast  # float32 products, whatever the caller's autocast
    def backward(ctx, grad):
        q, k, v, sin, cos, w, km = ctx.saved_tensors
        lam, eps, v_dtype = ctx.args
        need = ctx.needs_input_grad
        n = k.shape[2]
        # queries: F_q, den and num again, the output's gradient through the division
        fq, den = torch.ops.linattn_mm.nala_fused_features(q, km, sin, cos, lam, eps)
        num = fq @ w
        dnum = grad.to(torch.float32) / den.unsqueeze(-1)
        dden = (dnum * num).sum(-1).div_(den).neg_()
        del num, den
        dw = token_gram(fq, dnum)
        del fq
        dq = dks = None
        if need[0] or need[1]:  # dq, and the key means' gradient that dk takes
            dq, dkm = torch.ops.linattn_mm.nala_fused_query_grads(
                q, km, sin, cos, (dnum @ w.transpose(-2, -1)).contiguous(), dden, lam)
            dks = dkm.sum(1).mul_(1.0 / n)  # of the key feature sums
        del dnum, dden
        # keys: W = F_k^T v / n (RoPE: folded, the same map back), dv, dF_k
        da = dw.mul_(1.0 / n) if sin is None else rope_fold(dw, n)
        dv = dk = None
        if need[2]:
            fk, _ = torch.ops.linattn_mm.nala_fused_features(k, None, sin, cos, lam, eps)
            dv = (fk @ da).to(v_dtype)
            del fk
        if need[1]:
            dfk = (v.to(torch.float32) @ da.transpose(-2, -1)).contiguous()
            dk = torch.ops.linattn_mm.nala_fused_key_grads(k, sin, cos, dfk, dks, lam)
        return (dq.transpose(1, 2) if need[0] else None,
                dk.transpose(1, 2) if need[1] else None, dv, None, None, None, None, None)


def nala_attention_fused(q, k, v, power=3., eps=1e-6, sin=None, cos=None, v_keep=None):
    """Norm-aware linear attention (official kernel), the fused core (module docstring); the
    arguments of :func:`~linattn_mm.ops.nala.autograd.nala_attention_fast` for that kernel, the
    result float32 (a (B, h, N, d) view of a (B, N, h, d) buffer), gradients through
    :class:`NormAwareAttentionFused`. The RoPE needs the keys on the query grid, tables of shape
    (N, d) and an even head dim."""
    sin, cos = check_power_and_rope('nala_attention_fused', q, k, power, sin, cos)
    return NormAwareAttentionFused.apply(q, k, v, float(power), float(eps), sin, cos, v_keep)
