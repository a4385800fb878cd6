"""The training form of the Pola core: an autograd Function that keeps for backward only q, k, v,
the parameters and the two small (d, d + 2) matrices per head, and recomputes the polarity
features in its backward, where the gradients are written out analytically.

Forward (per head; :mod:`linattn_mm.ops.pola.fast`)::

    y = (x [+ b]) / s,   a = |y|^p,   x+ = a [y > 0],   x- = a [y < 0]        (x = q or k)
    W+ = [k+^T v_s | k-^T v_o | sum k+ | sum k-] / n,  W- = [k-^T v_s | k+^T v_o | sum k- | sum k+] / n
    r  = q+ W+ + q- W-  = [num_s | num_o | den_s | den_o],   out = num / (den + eps)  (per stream)

Backward, with ``g`` the output gradient and ``D = den + eps``::

    dnum = g / D,   dden_t = -sum_{c in stream t} g_c out_c / D_t,   dR = [dnum | dden]
    dq+ = dR W+^T,  dq- = dR W-^T,  dW+ = q+^T dR,  dW- = q-^T dR
    dk+^T v and the key sums' gradients from dW+, dW- (the column arrangement above, / n):
    dk+ = v dKV+^T + dks+,  dk- = v dKV-^T + dks-,  dv = k+ dKV+ + k- dKV-
    for x = q, k:  G = da * a with da = dx+ [y > 0] + dx- [y < 0];  dy = G p / y (0 at y = 0)
    dx = dy / s,  db = dy / s,  d(1/s) = sum dy (x [+ b]),  dp = sum G ln|y|,  ds = -d(1/s) / s^2

The gradients equal the plain autograd of the reference (tests: 1e-10 relative in float64, 1e-5 in
float32), including zeros at the ReLU boundary, where the reference's are 0 as well.
"""
import math

import torch

from ..common import numpy_log2_, token_gram
from ..common import in_dtype_of as _to
from .fast import chunk_rows, heads_buffer, polarity_forward, query_side, token_slice

__all__ = ['PolarityAttention', 'polarity_attention_fast']

_LN2 = math.log(2.)


class _PowerTerms:
    """``y = (x + bias) * inv_scale``, ``log2|y|`` and ``a = |y|^p`` of q or k, computed once in
    the backward for both the features (``x+ = a [y > 0]``, ``x- = a [y < 0]``) and their
    gradients (no autograd graph)."""

    def __init__(self, x, p, inv_scale, bias):
        self.x, self.p, self.inv_scale, self.bias = x, p, inv_scale, bias
        y = x if bias is None else x + bias
        self.y = y * inv_scale if inv_scale is not None else y.clone()
        self.log2 = numpy_log2_(self.y.abs())
        a = torch.exp2(self.log2 * p).copysign_(self.y)  # signed |y|^p
        self.pos = a.clamp_min(0)
        self.neg = a.neg_().add_(self.pos)  # relu(c) - c == relu(-c), exactly

    def features(self):
        """``(x+, x-)``."""
        return self.pos, self.neg

    def backward(self, dpos, dneg, out=None):
        """From the gradients of ``x+``, ``x-`` to those of ``x`` (written into ``out`` if given;
        also the bias's: the same tensor, summed by the caller), of ``inv_scale`` and of ``p``
        (the latter two still to be summed to the parameters' shapes; ``p``'s also to be
        multiplied by ln 2)."""
        g = torch.addcmul(dpos * self.pos, dneg, self.neg)  # G = da * a (x+, x- hold a)
        zero = self.y == 0  # G = 0 there; 0 / 0 and 0 * log2(0) are set to 0
        dy = (g * self.p).div_(self.y).masked_fill_(zero, 0.)
        dp = g.mul_(self.log2).masked_fill_(zero, 0.)  # times ln 2 once summed
        if self.inv_scale is not None:
            dx = torch.mul(dy, self.inv_scale, out=out)
        else:
            dx = dy if out is None else out.copy_(dy)
        d_inv = None
        if self.inv_scale is not None:
            d_inv = dy.mul_(self.x if self.bias is None else self.x + self.bias)
        return dx, d_inv, dp


def _key_matrix_grads(dw_pos, dw_neg, d, n):
    """The gradients of ``k+^T v``, ``k-^T v`` (.., d, d) and of the key sums (.., d) from those of
    the query-side matrices ``W+``, ``W-`` (see the module docstring for their columns)."""
    d_s = (d + 1) // 2
    dkvp = torch.cat([dw_pos[..., :d_s], dw_neg[..., d_s:d]], dim=-1) / n
    dkvn = torch.cat([dw_neg[..., :d_s], dw_pos[..., d_s:d]], dim=-1) / n
    dksp = (dw_pos[..., d] + dw_neg[..., d + 1]) / n
    dksn = (dw_pos[..., d + 1] + dw_neg[..., d]) / n
    return dkvp, dkvn, dksp, dksn


def _add_sum(acc, t, shape):
    """``acc + t.sum_to_size(shape)`` (``acc`` None at first)."""
    s = t.sum_to_size(shape)
    return s.clone() if acc is None else acc.add_(s)


class PolarityAttention(torch.autograd.Function):
    """``polarity_attention_fast`` with the lean backward of the module docstring. Inputs:
    q (B, h, N, d), k, v (B, h, n, d), p (1, h, 1, d), eps, inv_scale (1, h, 1, d) or None,
    k_bias broadcastable to k or None, rows (tokens per chunk of the backward, None: by
    :data:`~linattn_mm.ops.pola.fast.TRAIN_CHUNK_ELEMENTS`).

    The backward runs over chunks of tokens: the query pass recomputes q+, q- and ``r`` for a
    chunk, writes its part of dq and accumulates the gradients of ``W+``, ``W-``; the key pass
    then does the same for k and v. No full-size temporary is made besides the gradients.

    The core computes in the wider of ``p``'s dtype and float32 (float64 for float64 q, k, v).
    q, k, v and ``k_bias`` may come in a lower precision (the projections under autocast): they
    are kept for backward as they are, not as float32 copies, cast chunk by chunk both ways, and
    get their gradients in their own dtypes."""

    @staticmethod
    def forward(ctx, q, k, v, p, eps, inv_scale, k_bias, rows):
        out, w_pos, w_neg = polarity_forward(q, k, v, p, eps, inv_scale, k_bias, rows)
        ctx.eps, ctx.rows = eps, rows
        ctx.save_for_backward(q, k, v, p, inv_scale, k_bias, w_pos, w_neg)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, p, inv_scale, k_bias, w_pos, w_neg = ctx.saved_tensors
        need = ctx.needs_input_grad
        N, n, d = q.shape[-2], k.shape[-2], q.shape[-1]
        d_s = (d + 1) // 2
        work = w_pos.dtype
        acc = dict(p=None, inv=None)
        want_p = need[3]
        want_inv = inv_scale is not None and need[5]

        def accumulate(d_inv, dp):
            if want_p:
                acc['p'] = _add_sum(acc['p'], dp, p.shape)
            if want_inv:
                acc['inv'] = _add_sum(acc['inv'], d_inv, inv_scale.shape)

        # queries, chunk by chunk: recompute q+, q- and r, then the output's gradient through
        # the division; accumulate the gradients of W+ and W-
        rows = chunk_rows(q, ctx.rows)
        dq = heads_buffer(q, N, work) if need[0] else None
        dw_pos = torch.zeros_like(w_pos)
        dw_neg = torch.zeros_like(w_neg)
        for i in range(0, N, rows):
            sl = slice(i, min(i + rows, N))
            terms = _PowerTerms(q[:, :, sl].to(work), p, inv_scale, None)
            qp, qn = terms.features()
            r = query_side(qp, qn, w_pos, w_neg)
            den = r[..., d:].add_(ctx.eps)  # (B, h, L, 2)
            g = grad[:, :, sl].to(work)
            dnum = torch.cat([g[..., :d_s] / den[..., :1], g[..., d_s:] / den[..., 1:]], dim=-1)
            prod = dnum * r[..., :d]  # g out / D
            dden = torch.stack([prod[..., :d_s].sum(-1), prod[..., d_s:].sum(-1)], dim=-1)
            dr = torch.cat([dnum, dden.div_(den).neg_()], dim=-1)  # (B, h, L, d + 2)
            del r, den, g, dnum, prod, dden
            token_gram(qp, dr, acc=dw_pos)
            token_gram(qn, dr, acc=dw_neg)
            dqp, dqn = dr @ w_pos.transpose(-2, -1), dr @ w_neg.transpose(-2, -1)
            del qp, qn, dr
            _, d_inv, dp = terms.backward(dqp, dqn, None if dq is None else dq[:, :, sl])
            accumulate(d_inv, dp)
        # keys, chunk by chunk: k+^T v, k-^T v and the key sums
        dkvp, dkvn, dksp, dksn = _key_matrix_grads(dw_pos, dw_neg, d, n)
        del dw_pos, dw_neg
        dksp, dksn = dksp.unsqueeze(-2), dksn.unsqueeze(-2)
        rows = chunk_rows(k, ctx.rows)
        dk = heads_buffer(k, n, work) if need[1] or need[6] else None
        dv = heads_buffer(v, n, work) if need[2] else None
        for i in range(0, n, rows):
            sl = slice(i, min(i + rows, n))
            terms = _PowerTerms(k[:, :, sl].to(work), p, inv_scale,
                                token_slice(k_bias, sl, n, work))
            kp, kn = terms.features()
            if dv is not None:
                dv[:, :, sl] = torch.matmul(kp, dkvp).add_(kn @ dkvn)
            vv = v[:, :, sl].to(work)
            dkp = (vv @ dkvp.transpose(-2, -1)).add_(dksp)
            dkn = (vv @ dkvn.transpose(-2, -1)).add_(dksn)
            del kp, kn, vv
            _, d_inv, dp = terms.backward(dkp, dkn, None if dk is None else dk[:, :, sl])
            accumulate(d_inv, dp)
        grads_p = acc['p'].mul_(_LN2) if want_p else None
        d_bias = None
        if k_bias is not None and need[6]:
            d_bias = dk.sum_to_size(k_bias.shape).to(k_bias.dtype)
        return (_to(dq, q), _to(dk, k) if need[1] else None, _to(dv, v), grads_p, None,
                acc['inv'] if want_inv else None, d_bias, None)


def polarity_attention_fast(q, k, v, p, eps=1e-6, temperature=None, k_bias=None, rows=None):
    """Polarity-aware linear attention, fast form; the arguments and the result of
    :func:`~linattn_mm.ops.pola.reference.polarity_attention_reference`.

    Args:
        q (Tensor): queries, (B, h, N, d).
        k (Tensor): keys, (B, h, n, d).
        v (Tensor): values, (B, h, n, d).
        p (Tensor): exponents broadcastable to (1, h, 1, d), all >= 1.
        eps (float): added to the (mean-normalised) denominators.
        temperature (Tensor, optional): ``softplus(scale)`` broadcastable to (1, h, 1, d); q and
            k are divided by it (here: multiplied by its inverse).
        k_bias (Tensor, optional): added to ``k`` before the temperature (the position encoding,
            broadcastable to (B, h, n, d)).
        rows (int, optional): tokens per chunk of the forward and the backward; None: by
            :func:`~linattn_mm.ops.pola.fast.chunk_rows` (the result does not depend on it beyond
            float rounding).

    Returns:
        Tensor: (B, h, N, d); channels ``[0, ceil(d/2))`` hold the same-signed stream, the rest the
        opposite-signed one, as in the reference; a (B, h, N, d) view of a (B, N, h, d) buffer
        (``transpose(1, 2).reshape(B, N, h*d)`` is then free). Gradients through
        :class:`PolarityAttention`.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f'polarity_attention_fast: q, k, v must be (B, h, N, d), got '
                         f'{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}')
    inv_scale = None if temperature is None else 1 / temperature
    return PolarityAttention.apply(q, k, v, p, eps, inv_scale, k_bias, rows)
