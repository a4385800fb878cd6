"""The fused training core of PolaFormer's polarity attention: the torch core's products, with its
elementwise passes as three Triton kernels (CUDA; ``core='fused'``).

The torch training Function (:mod:`linattn_mm.ops.pola.autograd`) makes the polarity features and
takes their gradients back through the powers in some twenty elementwise operations, each a pass
over a full (B, h, L, d) map; at 800×1344 those passes are most of the bytes a Pola-Swin-T training
step moves on a GPU (``docs/benchmarks.md``, "Operations and memory per training step"). The
Triton core (:mod:`linattn_mm.ops.pola.triton`) fuses everything, the products too, and Triton
lowers its float32 (d × d) products to FMA loops that run far below the tensor cores' rate. Here
each side keeps what it does best:

* **Features** (one Triton launch per map, forward and backward): read ``x`` (q, or k and its
  position encoding) in its own dtype, write ``[x+ | x-]`` (B, h, L, 2d) in float32:
  ``y = (x [+ b]) / s``, ``a = |y|^p`` as ``exp2(p log2|y|)``, ``x+ = a [y > 0]``,
  ``x- = a [y < 0]``.
* **Products** in torch, as the torch core has them (cuBLAS, float32): ``[k+; k-]^T [v | 1]``
  (the key sums are the column of the ones), ``r = [q+ | q-] [W+; W-]``,
  ``dW = [q+ | q-]^T dR``, ``[dq+ | dq-] = dR W^T``, ``dv = [k+ | k-] dKV``,
  ``[dk+ | dk-] = v dKV^T`` (the formulas of :mod:`linattn_mm.ops.pola.autograd`). The division
  by the denominators writes the result in the caller's dtype (``out_dtype``), rounded once.
* **The output's gradient** through the division (one Triton launch): read ``r`` and the
  output's gradient in its dtype, write ``dR = [g / D | -sum(g num) / D^2]`` per stream.
* **Feature gradients** (one Triton launch per map): read ``x``, its position encoding and
  ``[dx+ | dx-]``, recompute ``y``, ``log2|y|`` and ``a`` in registers, write
  ``dx = G p / y / s`` (``G = da·a``, 0 at y = 0) in the input's dtype and, per chunk of tokens,
  the partial sums of the exponents' gradient ``Σ G log2|y|`` (times ln 2 once summed) and of the
  inverse temperature's ``Σ (G p / y)(x [+ b])``. On the key side it adds the key sums' gradient
  ``dks``, one row per (batch, head), to every token's ``[dk+ | dk-]`` as it reads them.

Kept for backward: q, k, v (in their dtype, as they came), the position encoding, the parameters
and ``[W+; W-]`` (B, h, 2d, d + 2), as the torch Function keeps them. The gradients are those of
the plain autograd of the reference (tests: float32 to 1e-5 relative, bf16 and fp16 inputs to
their rounding). Inputs float32, bfloat16 or float16 (the core computes in float32), on CUDA, or
on CPU through Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check it
without a GPU. On ``meta`` tensors the launches make their outputs only, so the operation and
traffic counters see one operation each.

What these passes save, counted on ``meta`` (``docs/benchmarks.md``, "Operations and memory per
training step"): per stage-1 layer of Pola-Swin-T at batch 8, 800×1344, bf16, the key sums'
pass (0.41 GB), a contiguous copy of v each way (0.41 GB each), the casts of the result and of its
gradient (0.41 and 0.31 GB), the broadcast add of ``dks`` (0.83 GB), the merge of dv's heads
(0.21 GB), and the output's gradient in one pass instead of six (0.75 GB).
"""
from typing import Optional, Tuple

import torch

from ..common import backward_without_autocast, no_autocast, token_gram
from ..dispatch import (TRITON_DTYPES, fused_block, fused_chunks, fused_warps, launch_fitted,
                        padded_head_dims, triton_module)
from .autograd import _LN2, _key_side_grads
from .fast import _normalise_into, heads_buffer, joined_weights
from .triton import _expand_bias, _per_head, check_qkv

triton = triton_module()
if triton is not None:
    import triton.language as tl

    from .triton import _features, _load_tile, _power_grads, _power_terms, _program

__all__ = ['polarity_attention_fused', 'PolarityAttentionFused']

if triton is not None:

    @triton.jit
    def _pola_features_kernel(X, PE, P, S, F, L, h,
                              s_xb, s_xh, s_xn, s_xd, s_pb, s_ph, s_pn, s_pd,
                              D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                              HAS_PE: tl.constexpr, HAS_SCALE: tl.constexpr):
        bh, blk, b, head, rd, dmask = _program(h, D, DP)
        rn = blk * BLOCK + tl.arange(0, BLOCK)
        m = (rn < L)[:, None] & dmask[None, :]
        y = _load_tile(X, b, head, rn, rd, s_xb, s_xh, s_xn, s_xd, m)
        if HAS_PE:
            y += _load_tile(PE, b, head, rn, rd, s_pb, s_ph, s_pn, s_pd, m)
        if HAS_SCALE:
            y = y * tl.load(S + head * D + rd, mask=dmask, other=1.0)[None, :]
        pos, neg = _features(y, tl.load(P + head * D + rd, mask=dmask, other=1.0)[None, :])
        f = F + (bh * L + rn[:, None]) * (2 * D) + rd[None, :]
        tl.store(f, pos, mask=m)
        tl.store(f + D, neg, mask=m)

    @triton.jit
    def _pola_feature_grads_kernel(X, PE, P, S, DF, DB, DX, DINV, DPOW, L, h, chunk,
                                   s_xb, s_xh, s_xn, s_xd, s_pb, s_ph, s_pn, s_pd,
                                   s_db, s_dh, s_dn, s_dd,
                                   D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                                   HAS_PE: tl.constexpr, HAS_SCALE: tl.constexpr,
                                   HAS_DB: tl.constexpr):
        bh, split, b, head, rd, dmask = _program(h, D, DP)
        p = tl.load(P + head * D + rd, mask=dmask, other=1.0)[None, :]
        if HAS_DB:  # a row added to every token's [dx+ | dx-] (the key sums' gradient)
            db_pos = tl.load(DB + bh * 2 * D + rd, mask=dmask, other=0.0)[None, :]
            db_neg = tl.load(DB + bh * 2 * D + D + rd, mask=dmask, other=0.0)[None, :]
        if HAS_SCALE:
            inv_s = tl.load(S + head * D + rd, mask=dmask, other=1.0)[None, :]
        acc_inv = tl.zeros((DP, ), dtype=tl.float32)
        acc_pow = tl.zeros((DP, ), dtype=tl.float32)
        start = split * chunk
        for off in range(0, chunk, BLOCK):
            rn = start + off + tl.arange(0, BLOCK)
            m = (rn < L)[:, None] & dmask[None, :]
            xb = _load_tile(X, b, head, rn, rd, s_xb, s_xh, s_xn, s_xd, m)
            if HAS_PE:
                xb += _load_tile(PE, b, head, rn, rd, s_pb, s_ph, s_pn, s_pd, m)
            y = xb
            if HAS_SCALE:
                y = xb * inv_s
            l2, a, _, _ = _power_terms(y, p)
            df = DF + (bh * L + rn[:, None]) * (2 * D) + rd[None, :]
            dpos = tl.load(df, mask=m, other=0.0)
            dneg = tl.load(df + D, mask=m, other=0.0)
            if HAS_DB:
                dpos += db_pos
                dneg += db_neg
            dy, dpw = _power_grads(y, l2, a, dpos, dneg, p)  # 0 outside the tile (y = 0)
            acc_pow += tl.sum(dpw, axis=0)
            dx = dy
            if HAS_SCALE:
                acc_inv += tl.sum(dy * xb, axis=0)
                dx = dy * inv_s
            tl.store(DX + b * s_db + head * s_dh + rn[:, None] * s_dn + rd[None, :] * s_dd,
                     dx.to(DX.dtype.element_ty), mask=m)
        part = (bh * tl.num_programs(1) + split) * DP + rd
        tl.store(DINV + part, acc_inv)
        tl.store(DPOW + part, acc_pow)

    @triton.jit
    def _pola_output_grad_kernel(R, G, DR, L, h, eps, s_gb, s_gh, s_gn, s_gd,
                                 D: tl.constexpr, DS: tl.constexpr, DP: tl.constexpr,
                                 BLOCK: tl.constexpr):
        bh, blk, b, head, rd, dmask = _program(h, D, DP)
        rn = blk * BLOCK + tl.arange(0, BLOCK)
        rows = rn < L
        m = rows[:, None] & dmask[None, :]
        r = R + (bh * L + rn) * (D + 2)  # r = [num | den_same, den_opposite], contiguous
        num = tl.load(r[:, None] + rd[None, :], mask=m, other=0.0)
        den_s = tl.load(r + D, mask=rows, other=1.0) + eps
        den_o = tl.load(r + D + 1, mask=rows, other=1.0) + eps
        same = (rd < DS)[None, :]
        g = _load_tile(G, b, head, rn, rd, s_gb, s_gh, s_gn, s_gd, m)
        dnum = g / tl.where(same, den_s[:, None], den_o[:, None])
        t = dnum * num
        dden_s = -tl.sum(tl.where(same, t, 0.0), axis=1) / den_s
        dden_o = -tl.sum(tl.where(same, 0.0, t), axis=1) / den_o
        dr = DR + (bh * L + rn) * (D + 2)
        tl.store(dr[:, None] + rd[None, :], dnum, mask=m)
        tl.store(dr + D, dden_s, mask=rows)
        tl.store(dr + D + 1, dden_o, mask=rows)


# ------------------------------------------------------------------------------------------------
# The three launches as operators (``torch.ops.linattn_mm.pola_fused_*``), with fake forms: on
# ``meta`` tensors they have shapes, and the counters of linattn_mm.utils count what each kernel
# reads and writes.
# ------------------------------------------------------------------------------------------------
_LIB = 'linattn_mm::'


def _features_output(x):
    B, h, L, d = x.shape
    return torch.empty(B, h, L, 2 * d, dtype=torch.float32, device=x.device)


@torch.library.custom_op(_LIB + 'pola_fused_features', mutates_args=())
def _features_op(x: torch.Tensor, pe: Optional[torch.Tensor], p: torch.Tensor,
                 inv_s: Optional[torch.Tensor]) -> torch.Tensor:
    """``[x+ | x-]`` (B, h, L, 2d), float32, of ``x`` (B, h, L, d) with the position encoding
    ``pe`` (expanded to x's shape, or None), the exponents ``p`` and the inverse temperature
    ``inv_s`` ((h, d) float32, or None)."""
    B, h, L, d = x.shape
    f = _features_output(x)
    block = fused_block(d)
    pe_t = x if pe is None else pe
    launch_fitted(_pola_features_kernel, (B * h, triton.cdiv(L, block)),
        x, pe_t, p, p if inv_s is None else inv_s, f, L, h, *x.stride(), *pe_t.stride(),
        num_warps=fused_warps(), D=d, DP=padded_head_dims(d), BLOCK=block, HAS_PE=pe is not None,
        HAS_SCALE=inv_s is not None)
    return f


@_features_op.register_fake
def _(x, pe, p, inv_s):
    return _features_output(x)


def _grads_outputs(x, dx_dtype):
    B, h, L, d = x.shape
    DP = padded_head_dims(d)
    splits, chunk = fused_chunks(L, B * h, fused_block(d), x.device)
    part = torch.empty(B * h, splits, DP, dtype=torch.float32, device=x.device)
    return (x.new_empty(B, L, h, d, dtype=dx_dtype), part, torch.empty_like(part)), chunk


@torch.library.custom_op(_LIB + 'pola_fused_feature_grads', mutates_args=())
def _feature_grads_op(x: torch.Tensor, pe: Optional[torch.Tensor], p: torch.Tensor,
                      inv_s: Optional[torch.Tensor], df: torch.Tensor, db: Optional[torch.Tensor],
                      dx_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the gradient ``df`` (B, h, L, 2d) of ``[x+ | x-]`` (float32, contiguous), plus the
    row ``db`` (B, h, 1, 2d) (float32, contiguous; None: none) added to every token's: that of
    ``x`` (also of the position encoding), a (B, L, h, d) buffer in ``dx_dtype``, and per chunk
    of tokens the partial sums (B·h, chunks, DP) of the inverse temperature's gradient and of the
    exponents' (in units of ln 2)."""
    B, h, L, d = x.shape
    (dx, d_inv, d_pow), chunk = _grads_outputs(x, dx_dtype)
    dx_t = dx.transpose(1, 2)
    pe_t = x if pe is None else pe
    launch_fitted(_pola_feature_grads_kernel, (B * h, d_inv.shape[1]),
        x, pe_t, p, p if inv_s is None else inv_s, df, df if db is None else db, dx_t, d_inv,
        d_pow, L, h, chunk, *x.stride(), *pe_t.stride(), *dx_t.stride(), num_warps=fused_warps(),
        D=d, DP=padded_head_dims(d), BLOCK=fused_block(d), HAS_PE=pe is not None,
        HAS_SCALE=inv_s is not None, HAS_DB=db is not None)
    return dx, d_inv, d_pow


@_feature_grads_op.register_fake
def _(x, pe, p, inv_s, df, db, dx_dtype):
    return _grads_outputs(x, dx_dtype)[0]


@torch.library.custom_op(_LIB + 'pola_fused_output_grad', mutates_args=())
def _output_grad_op(r: torch.Tensor, grad: torch.Tensor, eps: float) -> torch.Tensor:
    """``dR = [dnum | dden]`` (B, h, L, d + 2), float32, of the query side's product
    ``r = [num | den]`` (float32, contiguous; ``eps`` is added to its denominators as they are
    read) from the output's gradient ``grad`` (B, h, L, d) in its own dtype and strides: the
    formulas of :func:`~linattn_mm.ops.pola.autograd._output_grad`, in one pass."""
    r = r.contiguous()
    B, h, L, d2 = r.shape
    d = d2 - 2
    dr = torch.empty_like(r)
    block = fused_block(d)
    launch_fitted(_pola_output_grad_kernel, (B * h, triton.cdiv(L, block)),
        r, grad, dr, L, h, eps, *grad.stride(), num_warps=fused_warps(), D=d, DS=(d + 1) // 2,
        DP=padded_head_dims(d), BLOCK=block)
    return dr


@_output_grad_op.register_fake
def _(r, grad, eps):
    return torch.empty_like(r)


def _feature_map(x, pe, p, inv_s):
    return torch.ops.linattn_mm.pola_fused_features(x, pe, p, inv_s)


def _feature_map_grads(x, pe, p, inv_s, df, dx_dtype, db=None):
    return torch.ops.linattn_mm.pola_fused_feature_grads(
        x, pe, p, inv_s, df.contiguous(), None if db is None else db.contiguous(), dx_dtype)


def _values_and_ones(v):
    """``[v | 1]`` (B, h, n, d + 1), float32, contiguous: against it the key features' one
    product gives ``[k+^T v | sum k+; k-^T v | sum k-]`` (no pass of its own for the sums)."""
    ones = torch.ones((), dtype=torch.float32, device=v.device).expand(*v.shape[:-1], 1)
    return torch.cat([v, ones], dim=-1)


class PolarityAttentionFused(torch.autograd.Function):
    """The fused core (module docstring). Inputs: q (B, h, N, d), k, v (B, h, n, d) (any strides;
    float32, bfloat16 or float16), p and inv_scale (broadcastable to (1, h, 1, d); inv_scale =
    1 / temperature or None), eps, k_bias (broadcastable to k, or None), out_dtype (of the
    result: float32, bfloat16 or float16; None: float32). The result is a (B, h, N, d) view of a
    (B, N, h, d) buffer, computed in float32 and rounded once, as it is written; its gradient is
    read in its dtype. q, k, v and k_bias get their gradients in their own dtypes, p and
    inv_scale in theirs."""

    @staticmethod
    def forward(ctx, q, k, v, p, eps, inv_scale, k_bias, out_dtype=None):
        with no_autocast(q.device):  # float32 products, whatever the caller's autocast
            return PolarityAttentionFused._forward(ctx, q, k, v, p, eps, inv_scale, k_bias,
                                                   out_dtype or torch.float32)

    @staticmethod
    def _forward(ctx, q, k, v, p, eps, inv_scale, k_bias, out_dtype):
        fn = 'polarity_attention_fused'
        B, h, N, n, d = check_qkv(fn, q, k, v, meta=True)
        if out_dtype not in TRITON_DTYPES:
            raise TypeError(f'{fn}: out_dtype must be float32, bfloat16 or float16, got '
                            f'{out_dtype}')
        pf = _per_head(p, h, d, 'p', fn).to(q.device)
        inv_s = None if inv_scale is None else \
            _per_head(inv_scale, h, d, 'temperature', fn).to(q.device)
        pe = _expand_bias(k_bias, (B, h, n, d), fn)
        fk = _feature_map(k, pe, pf, inv_s)
        kvs = token_gram(fk, _values_and_ones(v))  # [k+^T v | sum k+; k-^T v | sum k-]
        del fk
        w = joined_weights(kvs, n)
        out = _normalise_into(_feature_map(q, None, pf, inv_s) @ w, eps,
                              heads_buffer(q, N, out_dtype))  # rounded as the division writes
        ctx.save_for_backward(q, k, v, k_bias, pf, inv_s, w)
        ctx.eps = float(eps)
        ctx.p_meta = (p.shape, p.dtype)
        ctx.inv_meta = None if inv_scale is None else (inv_scale.shape, inv_scale.dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_without_autocast  # float32 products, whatever the caller's autocast
    def backward(ctx, grad):
        q, k, v, k_bias, pf, inv_s, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        B, h, N, d = q.shape
        n = k.shape[2]
        pe = _expand_bias(k_bias, (B, h, n, d))
        # queries: [q+ | q-] and r again, the output's gradient through the division, dW and
        # the features' gradient, then through the powers
        fq = _feature_map(q, None, pf, inv_s)
        dr = torch.ops.linattn_mm.pola_fused_output_grad(fq @ w, grad, ctx.eps)
        dw = token_gram(fq, dr)
        del fq
        params = need[3] or inv_s is not None and need[5]  # the exponents', the temperature's
        dq = d_inv_q = d_pow_q = None
        if need[0] or params:
            dq, d_inv_q, d_pow_q = _feature_map_grads(q, None, pf, inv_s,
                                                      dr @ w.transpose(-2, -1), q.dtype)
        del dr
        # keys: k+^T v, k-^T v and the key sums' gradients from dW
        dkv, dks = _key_side_grads(dw, d, n)
        del dw
        dv = None
        if need[2]:
            # cast into a (B, n, h, d) buffer: merging its heads copies nothing
            dv = heads_buffer(v, n, v.dtype).copy_(_feature_map(k, pe, pf, inv_s) @ dkv)
        bias_grad = k_bias is not None and need[6]
        if need[1] or bias_grad or params:  # the key side's feature gradients (the key sums'
            # gradient dks added by the kernel)
            v32 = v.to(torch.float32, memory_format=torch.contiguous_format)
            dfk = v32 @ dkv.transpose(-2, -1)
            del v32
            dk, d_inv_k, d_pow_k = _feature_map_grads(k, pe, pf, inv_s, dfk,
                                                      torch.float32 if bias_grad else k.dtype,
                                                      dks)
            del dfk
        else:
            dk = d_inv_k = d_pow_k = None

        def per_param(q_part, k_part, meta, scale=1.0):
            total = q_part.sum(1).add_(k_part.sum(1)).view(B, h, -1)[..., :d].sum(0)
            shape, dtype = meta
            return total.mul_(scale).view(1, h, 1, d).sum_to_size(shape).to(dtype)

        d_p = per_param(d_pow_q, d_pow_k, ctx.p_meta, _LN2) if need[3] else None
        d_inv = per_param(d_inv_q, d_inv_k, ctx.inv_meta) if inv_s is not None and need[5] \
            else None
        dk = None if dk is None else dk.transpose(1, 2)
        d_bias = dk.sum_to_size(k_bias.shape).to(k_bias.dtype) if bias_grad else None
        return (dq.transpose(1, 2) if need[0] else None, dk.to(k.dtype) if need[1] else None,
                dv, d_p, None, d_inv, d_bias, None)


def polarity_attention_fused(q, k, v, p, eps=1e-6, temperature=None, k_bias=None,
                             out_dtype=None):
    """Polarity-aware linear attention, the fused core (module docstring); the arguments and the
    result of :func:`~linattn_mm.ops.pola.autograd.polarity_attention_fast` (a (B, h, N, d) view
    of a (B, N, h, d) buffer) in ``out_dtype`` (None: float32), with gradients through
    :class:`PolarityAttentionFused`."""
    inv_scale = None if temperature is None else temperature.reciprocal()
    return PolarityAttentionFused.apply(q, k, v, p, eps, inv_scale, k_bias, out_dtype)
