"""Fast pure-torch kernel of PolaFormer's polarity-aware linear attention core.

Same maths as :func:`linattn_mm.ops.pola.reference.polarity_attention_reference` (the official
order of operations), reorganised so that fewer and cheaper passes over the (N, d) tensors are
made. Measured on CPU fp32 (``tools/benchmark.py --mode attention``), the dominant costs of the
official form are the four ``pow`` calls with a per-channel tensor exponent (one scalar
``exp(p log x)`` each per element), the ``cat`` copies and the elementwise passes of the
``n^-1/2`` rescaling, not the GEMMs (which are O(N d^2) and skinny).

* **One pow per tensor.** ``relu(x)^p`` and ``relu(-x)^p`` have disjoint support, so
  ``a = |x / s|^p`` is computed once; with ``c = copysign(a, x)``, ``pos = relu(c)`` and
  ``neg = pos - c`` are exact (``c - c == 0``, ``0 - c == |c|``) and are written straight into
  the two halves of one ``[x+ | x-]`` buffer (no concatenation copy is made). ``torch.where`` is
  avoided on purpose: its CPU kernel is several times slower than ``clamp``/``sub``.
* **Temperature folded.** ``|x / s|`` is ``|x| * (1 / s)`` (``s > 0`` keeps the sign of ``x``), so
  no separate ``q / s`` and ``k / s`` tensors are made.
* **One query-side GEMM for both streams and both normalisers.** ``q_opp @ X == q_sim @ swap(X)``
  (swap exchanges the two d-row halves), so with ``kk = [k+, k-]`` the small matrix
  ``W = [kk^T v, arranged per stream | sum(kk), sum(swap(kk))] / n`` of shape (2d, d + 2) gives the
  numerators of the two streams *and* their two denominators from one ``q_sim @ W`` (the
  EfficientViT "ones column" trick, done on the d x d side instead of padding V). ``q_opp`` is
  never materialised. The training form stacks ``W`` for ``q+`` and the one for ``q-``
  (``[W+; W-]``, :func:`joined_query_weights`), so that the joined features ``[q+ | q-]`` meet
  both in one product, forward and backward.
* **Scalars folded.** The official form scales K and V by ``n^-1/2`` (two full passes) and takes a
  mean; here only the (2d, d + 2) matrix is divided by ``n``.
* **Layout.** The result is written directly in (B, N, h, d) memory order, so merging the heads
  afterwards is a free view.

This is the forward of the training Function :class:`linattn_mm.ops.pola.autograd.
PolarityAttention` (which recomputes the features in its backward) and of the inference forms.
Results equal the reference up to float rounding (tests: 1e-5 relative in float32, 1e-10 in
float64, gradients included).
"""
import torch

from ..common import (add_or_take, core_chunk_rows, core_dtype, heads_buffer, into, numpy_log2_,
                      promote_types, sign_split, token_chunks, token_gram, token_slice)

__all__ = ['polarity_features', 'polarity_forward', 'joined_query_weights', 'joined_weights',
           'chunk_rows', 'heads_buffer', 'token_slice', 'joint_pass', 'joint_scaled',
           'TRAIN_CHUNK_ELEMENTS']


def polarity_features(x, p, inv_scale=None, bias=None):
    """``[relu(y)^p, relu(-y)^p]`` with ``y = (x + bias) * inv_scale``, concatenated on the last
    dim, with one power per element of ``x`` (no autograd graph).

    Args:
        x (Tensor): (..., L, d), any strides.
        p (Tensor): exponents broadcastable to ``x``, all > 0.
        inv_scale (Tensor, optional): positive multiplier broadcastable to ``x``.
        bias (Tensor, optional): added to ``x`` first (broadcastable to ``x``).

    Returns:
        Tensor: (..., L, 2d), contiguous.
    """
    shape = torch.broadcast_shapes(x.shape, p.shape)
    c = _scaled_into(x, inv_scale, bias, torch.empty(shape, dtype=x.dtype, device=x.device))
    return _features_of_scaled(c, p)


def _features_of_scaled(c, p):
    """``[relu(c)^p, relu(-c)^p]`` (..., 2d) of the scaled ``c`` (contiguous, (..., d))."""
    # |c|^p as 2^(p * log2|c|): the vectorised exp2/log2 are ~2x faster than CPU pow with a
    # per-channel exponent, and CPU exp2 ~2.5x faster than exp (log2 0 = -inf -> 2^-inf = 0, as
    # 0^p); ~1 ulp * |p log2|c|| apart from pow
    a = numpy_log2_(c.abs()).mul_(p).exp2_()
    a.copysign_(c)  # signed |x/s|^p (CPU copysign is slow on strided operands: keep contiguous)
    return sign_split(a)


def joint_pass(q, k, rows_q, rows_k):
    """Whether the queries and the keys are one chunk each with the same shape (self-attention
    without key reduction: off CPU always, on CPU for maps up to a chunk): then their features are
    computed as one stacked (2, ..) tensor, one pass of each operation for both
    (:func:`joint_scaled`)."""
    return q.shape == k.shape and rows_q >= q.shape[-2] and rows_k >= k.shape[-2]


def joint_scaled(q, k, inv_scale, k_bias, dtype):
    """``[q * inv_scale; (k + k_bias) * inv_scale]`` (2, B, h, N, d), contiguous, in ``dtype``
    (each optional term may be None): both inputs of the feature maps in one buffer."""
    y = torch.empty((2, ) + tuple(q.shape), dtype=dtype, device=q.device)
    _scaled_into(q, inv_scale, None, y[0])
    # the bias in dtype: a sum of two half-precision operands would be rounded to theirs
    _scaled_into(k, inv_scale, None if k_bias is None else k_bias.to(dtype), y[1])
    return y


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
    """Numerators over denominators: ``r`` (..., d + 2) (the query-side GEMM's result; its
    denominators get ``eps`` added in place) into ``out`` (..., d), a view of any layout. The
    first ``ceil(d / 2)`` channels of each head are the same-signed stream (column ``d`` is its
    denominator), the rest the opposite-signed one."""
    d = r.shape[-1] - 2
    d_s = (d + 1) // 2
    num, den = r[..., :d], r[..., d:].add_(eps)
    if 2 * d_s == d:
        into(torch.div, out.unflatten(-1, (2, d_s)), num.unflatten(-1, (2, d_s)),
             den.unsqueeze(-1))
    else:  # odd head dim: unequal halves
        into(torch.div, out[..., :d_s], num[..., :d_s], den[..., :1])
        into(torch.div, out[..., d_s:], num[..., d_s:], den[..., 1:])
    return out


def joined_query_weights(kv, ks, n):
    """``W = [W+; W-]`` (.., 2d, d + 2), the matrices the query features ``[q+ | q-]`` meet in
    one product (as :func:`_query_weights`), from ``kv = [k+^T v; k-^T v]`` (.., 2d, d) and the
    key sums ``ks = [sum k+; sum k-]`` (.., 2d, 1): the rows of ``[kv | ks]`` rolled by d are
    ``[k-^T v | sum k-; k+^T v | sum k+]``, the other stream's halves."""
    return joined_weights(torch.cat([kv, ks], dim=-1), n)


def joined_weights(kvs, n):
    """:func:`joined_query_weights` from ``kvs = [kv | ks]`` (.., 2d, d + 1), the two joined
    (as one product against the values with a column of ones gives them)."""
    d = kvs.shape[-1] - 1
    d_s = (d + 1) // 2
    rolled = kvs.roll(d, -2)
    return torch.cat([kvs[..., :d_s], rolled[..., d_s:d], kvs[..., d:], rolled[..., d:]],
                     dim=-1).mul_(1.0 / n)


#: elements of one (B, h, rows, d) chunk of the torch kernel and its training backward on CPU:
#: rows = ``TRAIN_CHUNK_ELEMENTS // (B h d)`` tokens, at least ``MIN_CHUNK_ROWS``; a chunk's
#: temporaries then stay in the core's caches instead of being fresh full-size maps
TRAIN_CHUNK_ELEMENTS = 2 ** 17


def chunk_rows(q, rows=None):
    """Tokens per chunk for (B, h, N, d) tensors like ``q``
    (:func:`~linattn_mm.ops.common.core_chunk_rows` of :data:`TRAIN_CHUNK_ELEMENTS`)."""
    return core_chunk_rows('polarity_attention_fast', q, rows, TRAIN_CHUNK_ELEMENTS)


def polarity_forward(q, k, v, p, eps, inv_scale, k_bias, rows=None):
    """The kernel's computation on (B, h, N, d) / (B, h, n, d) tensors, without an autograd graph,
    over chunks of tokens (:func:`chunk_rows`): the key pass accumulates ``[k+; k-]^T v`` and the
    key sums from the features ``[k+ | k-]`` (one (.., L, 2d) buffer), the query pass writes its
    chunk of the output from one product ``[q+ | q-] @ W`` (``W = [W+; W-]``, see
    :func:`joined_query_weights`) that gives both streams' numerators and denominators. It
    computes in the wider of the dtypes of ``p`` and of :func:`~linattn_mm.ops.common.core_dtype`
    of q, k, v: q, k, v and ``k_bias`` may come in a lower precision (half precision under
    autocast) and are cast chunk by chunk. Where q and k are one chunk each of the same shape
    (:func:`joint_pass`), both feature maps are one stacked pass instead of the two loops. Returns
    the output (a (B, h, N, d) view of a (B, N, h, d) buffer) and ``W`` (B, h, 2d, d + 2)."""
    B, h, N, d = q.shape
    n = k.shape[-2]
    work = promote_types(p.dtype, core_dtype(q, k, v))
    step_k, step_q = chunk_rows(k, rows), chunk_rows(q, rows)
    fq = None
    if joint_pass(q, k, step_q, step_k):  # one pass of the feature maps for q and k
        fq, fk = _features_of_scaled(joint_scaled(q, k, inv_scale, k_bias, work), p).unbind(0)
        kv = token_gram(fk, v.to(work))
        ks = fk.sum(dim=-2).unsqueeze(-1)
        del fk
    else:
        kv = ks = None
        for sl in token_chunks(n, step_k):
            f = polarity_features(k[:, :, sl].to(work), p, inv_scale,
                                  token_slice(k_bias, sl, n, work))
            kv = token_gram(f, v[:, :, sl].to(work), acc=kv)
            s = f.sum(dim=-2).unsqueeze(-1)
            ks = add_or_take(ks, s)
            del f
    w = joined_query_weights(kv, ks, n)
    out = heads_buffer(q, N, w.dtype)
    for sl in token_chunks(N, step_q):
        if fq is None:
            r = polarity_features(q[:, :, sl].to(work), p, inv_scale) @ w
        else:
            r, fq = fq @ w, None
        _normalise_into(r, eps, out[:, :, sl])
    return out, w
