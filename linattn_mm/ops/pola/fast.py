"""Fast pure-torch kernel of PolaFormer's polarity-aware linear attention core.

Same maths as :func:`linattn_mm.ops.pola.reference.polarity_attention_reference` (the official
order of operations), reorganised so that fewer and cheaper passes over the (N, d) tensors are
made. Measured on CPU fp32 (``tools/benchmark.py --mode attention``), the dominant costs of the
official form are the four ``pow`` calls with a per-channel tensor exponent (one scalar
``exp(p log x)`` each per element), the ``cat`` copies and the elementwise passes of the
``n^-1/2`` rescaling, not the GEMMs (which are O(N d^2) and skinny).

* **One pow per tensor.** ``relu(x)^p`` and ``relu(-x)^p`` have disjoint support, so
  ``a = |x / s|^p`` is computed once; with ``c = copysign(a, x)``, ``pos = relu(c)`` and
  ``neg = pos - c`` are exact (``c - c == 0``, ``0 - c == |c|``) and are written straight into the two halves of the
  feature buffer ``[relu(x)^p, relu(-x)^p]`` (no ``cat`` copy in inference). ``torch.where`` is
  avoided on purpose: its CPU kernel is several times slower than ``clamp``/``sub``.
* **Temperature folded.** ``|x / s|`` is ``|x| * (1 / s)`` (``s > 0`` keeps the sign of ``x``), so
  no separate ``q / s`` and ``k / s`` tensors are made.
* **One query-side GEMM for both streams and both normalisers.** ``q_opp @ X == q_sim @ swap(X)``
  (swap exchanges the two d-row halves), so with ``kk = [k+, k-]`` the small matrix
  ``W = [kk^T v, arranged per stream | sum(kk), sum(swap(kk))] / n`` of shape (2d, d + 2) gives the
  numerators of the two streams *and* their two denominators from one ``q_sim @ W`` (the
  EfficientViT "ones column" trick, done on the d x d side instead of padding V). ``q_opp`` is
  never materialised.
* **Scalars folded.** The official form scales K and V by ``n^-1/2`` (two full passes) and takes a
  mean; here only the (2d, d + 2) matrix is divided by ``n``.
* **Layout.** In inference the result is written directly in (B, N, h, d) memory order, so merging
  the heads afterwards is a free view.

The kernel is differentiable: when any input requires a gradient, an autograd-safe variant of the
same computation is used (no ``out=`` / in-place ops). Results equal the reference up to float
rounding (tests: 1e-5 relative in float32, 1e-10 in float64, gradients included).
"""
import torch

from ..common import grad_needed, numpy_log2_, sign_split

__all__ = ['polarity_features', 'polarity_attention_fast']


def polarity_features(x, p, inv_scale=None, grad=None, bias=None):
    """``[relu(y)^p, relu(-y)^p]`` with ``y = (x + bias) * inv_scale``, concatenated on the last
    dim, with one ``pow`` per element of ``x``.

    Args:
        x (Tensor): (..., L, d), any strides.
        p (Tensor): exponents broadcastable to ``x``, all > 0.
        inv_scale (Tensor, optional): positive multiplier broadcastable to ``x``.
        bias (Tensor, optional): added to ``x`` first (broadcastable to ``x``).
        grad (bool, optional): build an autograd graph; default: when an input requires grad.

    Returns:
        Tensor: (..., L, 2d), contiguous.
    """
    if grad is None:
        grad = grad_needed(x, p, inv_scale, bias)
    if grad:
        if bias is not None:
            x = x + bias
        a = x.abs()
        if inv_scale is not None:
            a = a * inv_scale
        a = a.pow(p)
        pos = torch.relu(torch.copysign(a, x))
        return torch.cat([pos, a - pos], dim=-1)
    shape = torch.broadcast_shapes(x.shape, p.shape)
    c = _scaled_into(x, inv_scale, bias, torch.empty(shape, dtype=x.dtype, device=x.device))
    # |c|^p as 2^(p * log2|c|): the vectorised exp2/log2 are ~2x faster than CPU pow with a
    # per-channel exponent, and CPU exp2 ~2.5x faster than exp (log2 0 = -inf -> 2^-inf = 0, as
    # 0^p); ~1 ulp * |p log2|c|| apart from pow. Inference only: the gradient of this form is NaN
    # at c == 0.
    a = numpy_log2_(c.abs()).mul_(p).exp2_()
    a.copysign_(c)  # signed |x/s|^p (CPU copysign is slow on strided operands: keep contiguous)
    return sign_split(a)


def _scaled_into(x, inv_scale, bias, c):
    """``c = (x + bias) * inv_scale`` (either optional) into the contiguous buffer ``c``."""
    if bias is not None:
        torch.add(x, bias, out=c)
        if inv_scale is not None:
            c.mul_(inv_scale)
    elif inv_scale is not None:
        torch.mul(x, inv_scale, out=c)
    else:
        c.copy_(x)
    return c


def _pos_neg_into(x, p, inv_scale, bias, c, a):
    """``relu(y)^p`` into ``c`` and ``relu(-y)^p`` into ``a`` (contiguous buffers of the broadcast
    shape), ``y = (x + bias) * inv_scale``; returns ``(c, a)``. No autograd graph."""
    _scaled_into(x, inv_scale, bias, c)
    # |c|^p as 2^(p * log2|c|) (see polarity_features), then the sign of c
    numpy_log2_(torch.abs(c, out=a)).mul_(p).exp2_().copysign_(c)
    pos = torch.clamp_min(a, 0, out=c)
    return pos, torch.sub(pos, a, out=a)  # relu(c) - c == relu(-c), exactly


def _pos_neg_nograd(x, p, inv_scale=None, bias=None):
    """Inference form of :func:`polarity_features`: ``(relu(y)^p, relu(-y)^p)`` as two contiguous
    tensors, ``y = (x + bias) * inv_scale``, made with two buffers and in-place ops only."""
    c = torch.empty(torch.broadcast_shapes(x.shape, p.shape), dtype=x.dtype, device=x.device)
    return _pos_neg_into(x, p, inv_scale, bias, c, torch.empty_like(c))


def _query_weights(kvp, kvn, ksp, ksn, n, out_pos=None, out_neg=None):
    """The two (.., d, d + 2) matrices the query halves meet: q+ meets ``[k+ (same stream) | k-
    (opposite stream)]`` and q- meets ``[k- | k+]``, with the key sums as the two normaliser
    columns, all divided by ``n``. ``kvp = k+^T v``, ``kvn = k-^T v`` (.., d, d); ``ksp``, ``ksn``
    the key sums (.., d, 1)."""
    d_s = (kvp.shape[-1] + 1) // 2
    w_pos = torch.cat([kvp[..., :d_s], kvn[..., d_s:], ksp, ksn], dim=-1, out=out_pos)
    w_neg = torch.cat([kvn[..., :d_s], kvp[..., d_s:], ksn, ksp], dim=-1, out=out_neg)
    return w_pos.mul_(1.0 / n), w_neg.mul_(1.0 / n)


def _normalise_into(r, eps, out):
    """Numerators over denominators: ``r`` (..., d + 2) (the query-side GEMM's result, even d)
    into ``out`` (..., d), a view of any layout. The first ``d / 2`` channels of each head are the
    same-signed stream (column ``d`` is its denominator), the rest the opposite-signed one."""
    d = r.shape[-1] - 2
    num, den = r[..., :d], r[..., d:].add_(eps)
    torch.div(num.unflatten(-1, (2, d // 2)), den.unsqueeze(-1),
              out=out.unflatten(-1, (2, d // 2)))
    return out


def _fast_nograd(q, k, v, p, eps, inv_scale, k_bias):
    """Inference path of :func:`polarity_attention_fast`: the positive and negative feature halves
    stay separate buffers (no (N, 2d) concatenation is ever written) and the query-side GEMM is
    ``q+ @ W+`` accumulated with ``q- @ W-`` (``baddbmm``)."""
    n, d = k.shape[-2], q.shape[-1]
    d_s = (d + 1) // 2
    kp, kn = _pos_neg_nograd(k, p, inv_scale, k_bias)
    if not v.is_contiguous() and v.shape[0] > 1:
        v = v.contiguous()  # read by two GEMMs
    v = v.to(kp.dtype)
    w_pos, w_neg = _query_weights(kp.transpose(-2, -1) @ v, kn.transpose(-2, -1) @ v,
                                  kp.sum(dim=-2).unsqueeze(-1), kn.sum(dim=-2).unsqueeze(-1), n)
    qp, qn = _pos_neg_nograd(q, p, inv_scale)
    lead, N = qp.shape[:-2], qp.shape[-2]
    w_pos = w_pos.expand(*lead, d, d + 2).reshape(-1, d, d + 2)
    w_neg = w_neg.expand(*lead, d, d + 2).reshape(-1, d, d + 2)
    # accumulate in place through out= (FlopCounterMode does not count ``baddbmm_``, and the
    # out-of-place form would copy r)
    r = torch.bmm(qp.view(-1, N, d), w_pos)
    torch.baddbmm(r, qn.view(-1, N, d), w_neg, out=r)
    r = r.view(*lead, N, d + 2)
    if d_s * 2 != d:  # odd head dim: unequal halves
        num, den = r[..., :d], r[..., d:].add_(eps)
        return torch.cat([num[..., :d_s] / den[..., :1], num[..., d_s:] / den[..., 1:]], dim=-1)
    B, h = lead
    out = torch.empty(B, N, h, d, dtype=r.dtype, device=r.device).transpose(1, 2)
    return _normalise_into(r, eps, out)


def polarity_attention_fast(q, k, v, p, eps=1e-6, temperature=None, k_bias=None):
    """Polarity-aware linear attention, fast form (see the module docstring); the arguments and
    the result of :func:`~linattn_mm.ops.pola.reference.polarity_attention_reference`.

    Args:
        q (Tensor): queries, (B, h, N, d).
        k (Tensor): keys, (B, h, n, d).
        v (Tensor): values, (B, h, n, d).
        p (Tensor): exponents broadcastable to (B, h, 1, d), all >= 1.
        eps (float): added to the (mean-normalised) denominators.
        temperature (Tensor, optional): ``softplus(scale)`` broadcastable to (1, h, 1, d); q and
            k are divided by it (here: multiplied by its inverse).
        k_bias (Tensor, optional): added to ``k`` before the temperature (the position encoding,
            broadcastable to (B, h, n, d)).

    Returns:
        Tensor: (B, h, N, d); channels ``[0, ceil(d/2))`` hold the same-signed stream, the rest the
        opposite-signed one, as in the reference. Without a gradient it is a (B, h, N, d) view of a
        (B, N, h, d) buffer (``transpose(1, 2).reshape(B, N, h*d)`` is then free).
    """
    inv_scale = None if temperature is None else 1 / temperature
    if not grad_needed(q, k, v, p, inv_scale, k_bias) and q.dim() == 4:
        return _fast_nograd(q, k, v, p, eps, inv_scale, k_bias)
    n = k.shape[-2]
    d = q.shape[-1]
    d_s = (d + 1) // 2
    kk = polarity_features(k, p, inv_scale, True, bias=k_bias)  # (B, h, n, 2d) = [k+, k-]
    kv = kk.transpose(-2, -1) @ v.to(kk.dtype)  # (B, h, 2d, d): [k+^T v ; k-^T v]
    ksum = kk.sum(dim=-2).unsqueeze(-1)  # (B, h, 2d, 1)
    lead = kv.shape[:-2]
    kv2 = kv.view(*lead, 2, d, d)
    ks2 = ksum.view(*lead, 2, d, 1)
    # q slot s (s = +, -): the same-signed stream meets k block s, the opposite-signed the other
    w = torch.cat([kv2[..., :d_s], kv2.flip(-3)[..., d_s:], ks2, ks2.flip(-3)], dim=-1)
    w = w.reshape(*lead, 2 * d, d + 2) * (1.0 / n)
    r = polarity_features(q, p, inv_scale, True) @ w  # (B, h, N, d + 2): numerators | 2 dens
    num, den = r[..., :d], r[..., d:] + eps
    if d_s * 2 != d:  # odd head dim: unequal halves
        return torch.cat([num[..., :d_s] / den[..., :1], num[..., d_s:] / den[..., 1:]], dim=-1)
    return (num.unflatten(-1, (2, d_s)) / den.unsqueeze(-1)).flatten(-2)
