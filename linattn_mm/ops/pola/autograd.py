"""The training form of the Pola core: an autograd Function that keeps for backward only q, k, v,
the parameters and the small (2d, d + 2) matrix ``[W+; W-]`` per head, and recomputes the
polarity features in its backward, where the gradients are written out analytically. The
features of q (and of k) are one buffer ``[x+ | x-]`` (.., L, 2d), so that each pair of products
below is one product: ``r = [q+ | q-] [W+; W-]``, ``[dq+ | dq-] = dR [W+; W-]^T``,
``[dW+; dW-] = [q+ | q-]^T dR``, and on the key side ``[k+; k-]^T v``, ``dv = [k+ | k-] dKV``.

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

from ..common import (backward_without_autocast, heads_buffer, into, numpy_log2_, sign_split,
                      sign_split_dot, token_chunks, token_gram, token_slice)
from ..common import in_dtype_of as _to
from .fast import _scaled_into, chunk_rows, joint_pass, joint_scaled, polarity_forward

__all__ = ['PolarityAttention', 'polarity_attention_fast']

_LN2 = math.log(2.)


class _PowerTerms:
    """``y = (x + bias) * inv_scale``, ``log2|y|`` and ``a = |y|^p`` of q or k (or of both,
    stacked), computed once in the backward for both the features ``[x+ | x-]`` (one (.., L, 2d)
    buffer: ``x+ = a [y > 0]``, ``x- = a [y < 0]``) and their gradients (no autograd graph).
    ``y`` may be given (then ``x`` is it: no temperature, no bias)."""

    def __init__(self, x, p, inv_scale, bias, y=None):
        self.x, self.p, self.inv_scale, self.bias = x, p, inv_scale, bias
        shape = torch.broadcast_shapes(x.shape, p.shape)
        # contiguous (B, h, L, d), whatever the strides of x: the products over the tokens of
        # the features then need no copy
        self.y = y if y is not None else _scaled_into(x, inv_scale, bias, x.new_empty(shape))
        self.log2 = numpy_log2_(self.y.abs())
        a = torch.mul(self.log2, p).exp2_().copysign_(self.y)  # signed |y|^p
        self.f = sign_split(a)  # [relu(a) | relu(-a)], exactly

    def backward(self, df, out=None):
        """From the gradient of ``[x+ | x-]`` (.., L, 2d) to those of ``x`` (written into ``out``
        if given; also the bias's: the same tensor, summed by the caller), of ``inv_scale`` and
        of ``p`` (the latter two still to be summed to the parameters' shapes; ``p``'s also to be
        multiplied by ln 2)."""
        g = sign_split_dot(df, self.f)  # G = da * a (x+, x- hold a)
        zero = self.y == 0  # G = 0 there; 0 / 0 and 0 * log2(0) are set to 0
        dy = (g * self.p).div_(self.y).masked_fill_(zero, 0.)
        dp = g.mul_(self.log2).masked_fill_(zero, 0.)  # times ln 2 once summed
        if self.inv_scale is not None:
            dx = torch.mul(dy, self.inv_scale) if out is None else into(torch.mul, out, dy,
                                                                         self.inv_scale)
        else:
            dx = dy if out is None else out.copy_(dy)
        d_inv = None
        if self.inv_scale is not None:
            d_inv = dy.mul_(self.x if self.bias is None else self.x + self.bias)
        return dx, d_inv, dp


def _output_grad(r, grad, eps):
    """``dR = [dnum | dden]`` (.., L, d + 2) of the query-side result ``r = [num | den]`` (its
    denominators get ``eps`` added in place) from the output's gradient ``grad`` (.., L, d):
    ``dnum = g / D`` per stream, ``dden_t = -sum_{c in stream t} g_c num_c / D_t^2``."""
    d = grad.shape[-1]
    d_s = (d + 1) // 2
    num, den = r[..., :d], r[..., d:].add_(eps)
    dr = torch.empty_like(r)
    dnum, dden = dr[..., :d], dr[..., d:]
    if 2 * d_s == d:  # even d: the two streams as one (.., 2, d / 2) view
        into(torch.div, dnum.unflatten(-1, (2, d_s)), grad.unflatten(-1, (2, d_s)),
             den.unsqueeze(-1))
        into(torch.sum, dden, (dnum * num).unflatten(-1, (2, d_s)), -1)
    else:
        for t, c in enumerate((slice(0, d_s), slice(d_s, d))):
            into(torch.div, dnum[..., c], grad[..., c], den[..., t:t + 1])
            into(torch.sum, dden[..., t:t + 1], dnum[..., c] * num[..., c], -1, keepdim=True)
    dden.div_(den).neg_()
    return dr


def _key_side_grads(dw, d, n):
    """From the gradient of ``W = [W+; W-]`` (.., 2d, d + 2) (the query-side matrices stacked;
    see the module docstring for their columns) to those of the key side: ``K = [d(k+^T v);
    d(k-^T v)]`` (.., 2d, d) and the key sums' ``S = [d sum k+, d sum k-]`` (.., 1, 2d). Row j of
    ``W+`` and row j of ``W-`` meet the same key feature's two streams, so the rows of W rolled
    by d (``[W-; W+]``) give the other halves."""
    d_s = (d + 1) // 2
    dw = dw / n
    rolled = dw.roll(d, -2)
    dkv = torch.cat([dw[..., :d_s], rolled[..., d_s:d]], dim=-1)
    dks = torch.add(dw[..., d], rolled[..., d + 1]).unsqueeze(-2)
    return dkv, dks


def _add_sum(acc, t, shape):
    """``acc + t.sum_to_size(shape)`` (``acc`` None at first)."""
    s = t.sum_to_size(shape)
    if acc is None:
        return s.clone() if s is t else s
    return acc.add_(s)


class PolarityAttention(torch.autograd.Function):
    """``polarity_attention_fast`` with the lean backward of the module docstring. Inputs:
    q (B, h, N, d), k, v (B, h, n, d), p (1, h, 1, d), eps, inv_scale (1, h, 1, d) or None,
    k_bias broadcastable to k or None, rows (tokens per chunk of the backward, None: by
    :data:`~linattn_mm.ops.pola.fast.TRAIN_CHUNK_ELEMENTS`).

    The backward runs over chunks of tokens: the query pass recomputes ``[q+ | q-]`` and ``r``
    for a chunk, writes its part of dq and accumulates the gradient of ``[W+; W-]``; the key pass
    then does the same for k and v. With several chunks no full-size temporary is made besides
    the gradients. Where q and k are one chunk each of the same shape (self-attention without key
    reduction: the default off CPU, and on CPU for maps up to a chunk;
    :func:`~linattn_mm.ops.pola.fast.joint_pass`), the forward and the backward compute the
    features of both as one stacked (2, B, h, N, 2d) tensor: each elementwise step is one
    operation for both (on a GPU at batch 1 the host's launches set the pace), the same products
    as the loops, with full-size temporaries (as any one-chunk pass).

    The core computes in the wider of ``p``'s dtype and float32 (float64 for float64 q, k, v).
    q, k, v and ``k_bias`` may come in a lower precision (the projections under autocast): they
    are kept for backward as they are, not as float32 copies, cast as they are read (chunk by
    chunk in the loops), and get their gradients in their own dtypes."""

    @staticmethod
    def forward(ctx, q, k, v, p, eps, inv_scale, k_bias, rows):
        out, w = polarity_forward(q, k, v, p, eps, inv_scale, k_bias, rows)
        ctx.eps, ctx.rows = eps, rows
        ctx.save_for_backward(q, k, v, p, inv_scale, k_bias, w)
        return out

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad):
        q, k, v, p, inv_scale, k_bias, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        N, n, d = q.shape[-2], k.shape[-2], q.shape[-1]
        work = w.dtype
        acc = dict(p=None, inv=None)
        want_p = need[3]
        want_inv = inv_scale is not None and need[5]

        def accumulate(d_inv, dp):
            if want_p:
                acc['p'] = _add_sum(acc['p'], dp, p.shape)
            if want_inv:
                acc['inv'] = _add_sum(acc['inv'], d_inv, inv_scale.shape)

        rows_q, rows_k = chunk_rows(q, ctx.rows), chunk_rows(k, ctx.rows)
        if joint_pass(q, k, rows_q, rows_k):
            dq, dk, dv, d_inv, dp = _joint_backward(q, k, v, p, inv_scale, k_bias, w, grad,
                                                    ctx.eps, need)
            accumulate(d_inv, dp)
            return _grads(q, k, v, p, k_bias, need, dq, dk, dv, acc, want_p, want_inv)
        # queries, chunk by chunk: recompute [q+ | q-] and r, then the output's gradient
        # through the division; accumulate the gradient of W = [W+; W-] (B, h, 2d, d + 2)
        rows = rows_q
        dq = heads_buffer(q, N, work) if need[0] else None
        dw = None
        for sl in token_chunks(N, rows):
            terms = _PowerTerms(q[:, :, sl].to(work), p, inv_scale, None)
            dr = _output_grad(terms.f @ w, grad[:, :, sl].to(work), ctx.eps)
            dw = token_gram(terms.f, dr, acc=dw)
            df = dr @ w.transpose(-2, -1)
            del dr
            _, d_inv, dp = terms.backward(df, None if dq is None else dq[:, :, sl])
            accumulate(d_inv, dp)
        # keys, chunk by chunk: k+^T v, k-^T v and the key sums
        dkv, dks = _key_side_grads(dw, d, n)
        del dw
        rows = rows_k
        dk = heads_buffer(k, n, work) if need[1] or need[6] else None
        dv = heads_buffer(v, n, work) if need[2] else None
        for sl in token_chunks(n, rows):
            terms = _PowerTerms(k[:, :, sl].to(work), p, inv_scale,
                                token_slice(k_bias, sl, n, work))
            if dv is not None:
                dv[:, :, sl] = terms.f @ dkv
            df = (v[:, :, sl].to(work) @ dkv.transpose(-2, -1)).add_(dks)
            _, d_inv, dp = terms.backward(df, None if dk is None else dk[:, :, sl])
            accumulate(d_inv, dp)
        return _grads(q, k, v, p, k_bias, need, dq, dk, dv, acc, want_p, want_inv)


def _grads(q, k, v, p, k_bias, need, dq, dk, dv, acc, want_p, want_inv):
    """The Function's gradients, in the inputs' dtypes, from those of q, k, v (in the working
    dtype) and the sums of the exponents' and the inverse temperature's."""
    grads_p = acc['p'].mul_(_LN2) if want_p else None
    d_bias = None
    if k_bias is not None and need[6]:
        d_bias = dk.sum_to_size(k_bias.shape).to(k_bias.dtype)
    return (_to(dq, q), _to(dk, k) if need[1] else None, _to(dv, v), grads_p, None,
            acc['inv'] if want_inv else None, d_bias, None)


def _joint_backward(q, k, v, p, inv_scale, k_bias, w, grad, eps, need):
    """The backward in one pass when q and k are one chunk each with the same shape
    (:func:`~linattn_mm.ops.pola.fast.joint_pass`): the features of both
    are recomputed as one stacked (2, B, h, N, 2d) tensor and their gradients taken back through
    the powers as one, each operation one pass for both. The same products as the chunk loops.
    Returns dq, dk, dv (working dtype; dk None when neither k nor its bias needs one) and the
    stacked terms of the inverse temperature's and the exponents' gradients."""
    work, d, n = w.dtype, q.shape[-1], k.shape[-2]
    x = joint_scaled(q, k, None, k_bias, work)  # [q; k + bias], before the temperature
    terms = _PowerTerms(x, p, inv_scale, None, y=x if inv_scale is None else None)
    fq, fk = terms.f.unbind(0)
    dr = _output_grad(fq @ w, grad.to(work), eps)
    dw = token_gram(fq, dr)
    df = torch.empty_like(terms.f)
    torch.matmul(dr, w.transpose(-2, -1), out=df[0])
    del dr
    dkv, dks = _key_side_grads(dw, d, n)
    dv = None
    if need[2]:
        dv = heads_buffer(v, n, work)
        dv.copy_(fk @ dkv)
    torch.matmul(v.to(work), dkv.transpose(-2, -1), out=df[1]).add_(dks)
    B, h, N, _ = q.shape
    dx = None
    if need[0] or need[1] or need[6]:
        dx = torch.empty(2, B, N, h, d, dtype=work, device=q.device).transpose(2, 3)
    _, d_inv, dp = terms.backward(df, dx)
    dq, dk = (None, None) if dx is None else dx.unbind(0)
    return (dq if need[0] else None, dk if need[1] or need[6] else None, dv, d_inv, dp)


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
    inv_scale = None if temperature is None else temperature.reciprocal()
    return PolarityAttention.apply(q, k, v, p, eps, inv_scale, k_bias, rows)
