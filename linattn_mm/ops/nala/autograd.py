"""Training forms of the NaLa core: autograd Functions that keep q, k, v (the projection output,
kept anyway), the RoPE tables and a few small matrices, and recompute the feature maps in their
backward.

Official kernel, per head (:mod:`linattn_mm.ops.nala.fast`)::

    c = sign(q) |q / ||q|| |^p,  p = lam (0.5 + tanh ||q||),  fq = [relu(c), relu(-c)]       (N, 2d)
    ck = k^lam (sign kept),  fk = [relu(ck), relu(-ck)]                                       (N, 2d)
    den = fq . mean(fk) + eps
    no RoPE:   num = fq W,  W = fk^T v / N
    RoPE:      num = [fq cos, fq sin] W,  W = [M ; -R(M)],  M = (A_cos + R(A_sin)) / N,
               [A_cos ; A_sin] = [fk cos, fk sin]^T v,  R: row pairs (m0, m1) -> (-m1, m0)
    out = num / den

Backward, with ``g`` the output gradient (``R^T = -R``)::

    dnum = g / den,  dden = -(g . out) / den
    dF_q = dnum W^T,  dW = F_q^T dnum                      (F_q = fq or [fq cos, fq sin])
    RoPE:  dM = dW_top + R(dW_bottom),  dA_cos = dM / N,  dA_sin = -R(dM) / N
    dF_k = v dA^T,  dv = F_k dA                              (no RoPE: dA = dW / N)
    dfq = (RoPE: dF_q cos + dF_q' sin) + dden mean(fk),   dfk = (...) + sum_i(dden_i fq_i) / N
    keys:    dck = dfk+ [ck > 0] - dfk- [ck < 0],  dk = dck lam |k|^(lam - 1)
    queries: G = dc c (dc from dfq as for the keys),  dp = sum_i G_i ln(|q_i| / ||q||),
             dq = G p / q + (-p sum_i G_i / ||q|| + dp lam (1 - tanh^2 ||q||)) q / ||q||
    a constant query power (``query_power``): the ``dp`` term is dropped (p does not depend on q)

Exact zeros (a zero query element, or a zero query) give zero gradients, as in the reference.

On CPU the forward and both passes of the backward run over chunks of tokens (the per-token
terms above need only their own token; the sums over the tokens, ``W``, ``mean(fk)`` and their
gradients, are summed over the chunks): the query pass first, then the key pass, which needs the
whole ``dW`` and the gradient of ``mean(fk)``.

The paper's cos/sin kernel has no analytic backward here: :class:`RecomputedCore` keeps the inputs
only and runs the reference once more under autograd in its backward (gradients exactly those of
the reference; one more forward of the core in time).
"""
import math

import torch

from ..common import (add_or_take, backward_without_autocast, core_dtype, heads_buffer, kept_input,
                      sign_split, sign_split_dot, token_chunks, token_gram, token_slice)
from ..common import in_dtype_of as _to
from .fast import _key_power, _query_terms, _with_rope, chunk_rows, nala_forward, rope_fold
from .reference import nala_attention_reference

__all__ = ['NormAwareAttention', 'RecomputedCore', 'nala_attention_fast']

_LN2 = math.log(2.)


def _split_grad(df, x):
    """From the gradient of ``[relu(x), relu(-x)]`` (..., 2d) to that of ``x`` (..., d)."""
    d = x.shape[-1]
    return torch.where(x > 0, df[..., :d], torch.where(x < 0, -df[..., d:], 0.))


def _rope_grad(dF, sin, cos):
    """The gradient of ``f`` from that of ``[f cos | f sin]`` (..., 4d) (inverse of
    :func:`~linattn_mm.ops.nala.fast._with_rope`)."""
    D = dF.shape[-1] // 2
    d = cos.shape[-1]
    top = dF[..., :D].unflatten(-1, (D // d, d)) * cos.unsqueeze(-2)
    return top.addcmul_(dF[..., D:].unflatten(-1, (D // d, d)), sin.unsqueeze(-2)).flatten(-2)


class NormAwareAttention(torch.autograd.Function):
    """The official NaLa core with the backward of the module docstring. Inputs: q, k, v
    (B, h, N, d), ``power``, ``eps``, ``sin``, ``cos`` (N, d) or None, ``query_power`` (a constant
    query exponent, or None for the norm-aware one), ``v_keep``, ``rows`` (tokens per chunk; None:
    :func:`~linattn_mm.ops.nala.fast.chunk_rows`).

    The core computes in :func:`~linattn_mm.ops.common.core_dtype` of q, k, v (float32 for half
    precision): inputs in a lower precision (the projections under autocast) are kept for
    backward as they are, not as float32 copies, and get their gradients in their own dtypes.
    ``v_keep`` (optional): a lower-precision tensor with ``v_keep.to(v.dtype) == v`` exactly,
    kept instead of ``v`` (the NaLa mixer's float32 ``v`` feeds the LePE too, so that the two
    gradients of ``v`` are summed in float32).

    On CPU both passes run over chunks of tokens (as the Pola core's): the backward's query pass
    recomputes a chunk's features, writes its part of dq and sums the gradients of the key-side
    matrix and of the mean key features; the key pass then writes dk and dv chunk by chunk. Off
    CPU (and for maps of one chunk) each pass is one chunk."""

    @staticmethod
    def forward(ctx, q, k, v, power, eps, sin, cos, query_power=None, v_keep=None, rows=None):
        out, w, k_mean = nala_forward(q, k, v, power, eps, sin, cos, query_power, rows)
        ctx.power, ctx.eps, ctx.query_power, ctx.rows = power, eps, query_power, rows
        ctx.v_dtype = v.dtype  # a twin of another dtype may be kept instead of v
        ctx.save_for_backward(q, k, kept_input('NormAwareAttention', v, v_keep), sin, cos, w,
                              k_mean)
        return out

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad):
        q0, k0, v0, sin, cos, w, k_mean = ctx.saved_tensors
        need = ctx.needs_input_grad
        work = w.dtype
        N, n = q0.shape[-2], k0.shape[-2]
        step_q, step_k = chunk_rows(q0, ctx.rows), chunk_rows(k0, ctx.rows)
        if step_q >= N and step_k >= n:
            q, k, v = (t.to(work) for t in (q0, k0, v0))
            query = _QueryPass(ctx, q, grad, w, k_mean, sin, cos)
            dk, dv = _key_pass(ctx, k, v, query.dw, query.dk_mean, sin, cos, n)
            dq = query.input_grad()
        else:
            dq = heads_buffer(q0, N, work) if need[0] else None
            dw = dk_mean = None
            for sl in token_chunks(N, step_q):
                query = _QueryPass(ctx, q0[:, :, sl].to(work), grad[:, :, sl].to(work), w,
                                   k_mean, token_slice(sin, sl, N), token_slice(cos, sl, N), dw)
                dw = query.dw
                dk_mean = add_or_take(dk_mean, query.dk_mean)
                if dq is not None:
                    dq[:, :, sl] = query.input_grad()
                del query
            dk = heads_buffer(k0, n, work) if need[1] else None
            dv = heads_buffer(v0, n, work) if need[2] else None
            for sl in token_chunks(n, step_k):
                dk_c, dv_c = _key_pass(ctx, k0[:, :, sl].to(work), v0[:, :, sl].to(work), dw,
                                       dk_mean, token_slice(sin, sl, n), token_slice(cos, sl, n),
                                       n)
                if dk is not None:
                    dk[:, :, sl] = dk_c
                if dv is not None:
                    dv[:, :, sl] = dv_c
        return (_to(dq, q0), _to(dk, k0), None if dv is None else dv.to(ctx.v_dtype), None,
                None, None, None, None, None, None)


class _QueryPass:
    """The backward's query side on a chunk of queries ``q`` (B, h, L, d) with the output's
    gradient ``grad``: the gradient of the key-side matrix W summed into ``dw`` (``.dw``), that
    of the mean key features from these queries (``.dk_mean``, (B, h, 2d)), and the terms of the
    queries' own gradient (:meth:`input_grad`)."""

    def __init__(self, ctx, q, grad, w, k_mean, sin, cos, dw=None):
        rope = sin is not None
        self.ctx, self.q = ctx, q
        self.qn, self.p, self.rel, c = _query_terms(q, ctx.power, ctx.query_power)
        fq = sign_split(c)
        del c
        den = (fq @ k_mean.unsqueeze(-1)).add_(ctx.eps)  # (B, h, L, 1)
        Fq = _with_rope(fq, sin, cos) if rope else fq
        num = Fq @ w
        dnum = grad / den
        dden = -(dnum * num).sum(-1, keepdim=True) / den
        del num, den
        dFq, self.dw = dnum @ w.transpose(-2, -1), token_gram(Fq, dnum, acc=dw)
        del Fq, dnum
        dfq = _rope_grad(dFq, sin, cos) if rope else dFq
        del dFq
        dfq.addcmul_(dden, k_mean.unsqueeze(-2))
        self.dk_mean = (dden * fq).sum(-2)  # (B, h, 2d)
        del dden
        self.G = sign_split_dot(dfq, fq)  # dc c, exactly (dfq+ relu(c) + dfq- relu(-c))

    def input_grad(self):
        """dq (B, h, L, d): ``c = sign(q) 2^(p rel)``, ``rel = log2|q| - log2||q||``."""
        q, G, p, qn, lam = self.q, self.G, self.p, self.qn, self.ctx.power
        zero = q == 0  # G = 0 there: 0 / 0 and 0 * log2(0) are set to 0
        dq = (G * p).div_(q).masked_fill_(zero, 0.)
        # the norm's term -dqn q / ||q||, per token (B, h, L, 1): -dqn = p sum_i G_i / ||q||
        # [- dp lam (1 - tanh^2 ||q||) for the norm-aware power, 1 - tanh^2 = cosh^-2]
        neg_dqn = G.sum(-1, keepdim=True).mul_(p).div_(qn)
        if self.ctx.query_power is None:  # the norm-aware power: p depends on ||q||
            dp = G.mul_(self.rel).masked_fill_(zero, 0.).sum(-1, keepdim=True)  # times ln 2
            neg_dqn.addcmul_(dp, torch.cosh(qn).pow_(-2), value=-lam * _LN2)
        self.G = self.rel = None
        return dq.addcmul_(neg_dqn.div_(qn).masked_fill_(qn == 0, 0.), q, value=-1.)  # 0: zero q


def _key_pass(ctx, k, v, dw, dk_mean, sin, cos, N):
    """The backward's key side on a chunk of keys ``k`` and values ``v`` (B, h, L, d) from the
    whole gradient ``dw`` of the key-side matrix and ``dk_mean`` of the mean key features (``N``
    keys in all): returns dk and dv of the chunk."""
    lam, rope = ctx.power, sin is not None
    ck = _key_power(k, lam)
    fk = sign_split(ck)
    if rope:  # dM = dW_top + rot(dW_bottom), dA = [dM; -rot(dM)] / N: the forward's P
        dA = rope_fold(dw, N)
        Fk = _with_rope(fk, sin, cos)
    else:
        dA, Fk = dw * (1.0 / N), fk
    vv = v.to(fk.dtype)
    dv = Fk @ dA
    dFk = vv @ dA.transpose(-2, -1)
    del Fk, fk
    dfk = _rope_grad(dFk, sin, cos) if rope else dFk
    dfk.add_(dk_mean.unsqueeze(-2), alpha=1.0 / N)
    if lam > 1:  # d(k^lam)/dk = 0 at k = 0: the branch taken there does not matter (where
        # k^lam underflows to 0 for k != 0, dk is dfk- lam |k|^(lam-1), below 1e-38 in
        # float32, where the reference gives 0)
        d = k.shape[-1]
        dck = torch.where(ck > 0, dfk[..., :d], dfk[..., d:].neg())
    else:
        dck = _split_grad(dfk, ck)
    del dfk, dFk
    return dck.mul_(3 * k * k if lam == 3 else lam * k.abs().pow(lam - 1)), dv


class RecomputedCore(torch.autograd.Function):
    """A core that keeps only its inputs: the forward runs ``fn(*inputs)`` without a graph, the
    backward runs it again under autograd and differentiates it (the gradients of ``fn``).
    Arguments: ``fn``, the number of leading tensor inputs, then the inputs and other arguments."""

    @staticmethod
    def forward(ctx, fn, num_tensors, *args):
        ctx.fn, ctx.num_tensors, ctx.rest = fn, num_tensors, args[num_tensors:]
        ctx.save_for_backward(*args[:num_tensors])
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad):
        tensors = [t.detach().requires_grad_(need) if t is not None else None
                   for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:])]
        with torch.enable_grad():
            out = ctx.fn(*tensors, *ctx.rest)
        wrt = [t for t in tensors if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(out, wrt, grad, allow_unused=True))
        res = [next(grads) if t is not None and t.requires_grad else None for t in tensors]
        return (None, None, *res, *(None for _ in ctx.rest))


def nala_attention_fast(q, k, v, power=3., eps=1e-6, sin=None, cos=None, kernel='official',
                        query_power=None, v_keep=None, rows=None):
    """The NaLa core in its training form (the arguments and result of
    :func:`~linattn_mm.ops.nala.reference.nala_attention_reference`): the official kernel through
    :class:`NormAwareAttention` (the result is a (B, h, N, d) view of a (B, N, h, d) buffer;
    ``v_keep``: see there), the paper's kernel through :class:`RecomputedCore` (which keeps its
    inputs as they come; ``v_keep`` unused)."""
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f'nala_attention_fast: q, k, v must be (B, h, N, d) of one shape (the '
                         f'core attends over its own tokens), got {tuple(q.shape)}, '
                         f'{tuple(k.shape)}, {tuple(v.shape)}')
    qp = None if query_power is None else float(query_power)
    if kernel == 'official':
        return NormAwareAttention.apply(q, k, v, float(power), eps, sin, cos, qp, v_keep, rows)
    work = core_dtype(q, k, v)
    return RecomputedCore.apply(
        lambda q_, k_, v_, s_, c_, power_, eps_, kernel_, qp_: nala_attention_reference(
            q_.to(work), k_.to(work), v_.to(work), power_, eps_, s_, c_, kernel_, qp_), 5, q, k,
        v, sin, cos, power, eps, kernel, qp)
