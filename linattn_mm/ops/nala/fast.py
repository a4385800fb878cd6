"""Fast pure-torch kernel of NaLaFormer's norm-aware linear attention core (official kernel).

Same maths as :func:`linattn_mm.ops.nala.reference.nala_attention_reference` (the feature maps
and ``apply_rope`` in the official order of operations), reorganised so that fewer
passes over the (N, 2d) feature tensors are made:

* **One exp per query element for the power.** ``|d(q)|^p = 2^(p * (log2|q| - log2||q||))``: no
  ``q / ||q||`` tensor and no ``pow`` with a per-token tensor exponent (one scalar ``exp(p log x)``
  per element, the slowest element-wise op on CPU). The sign split is made from the signed result
  ``c``: ``relu(c)`` and ``relu(c) - c`` (exact), written into the two halves of the feature buffer.
  Keys: ``k^3`` as ``k * k * k`` (``lam = 3``) instead of ``|k|^3 * sign(k)``.
* **RoPE folded into the small matrices.** The 2-D RoPE rotates channel pairs that share one
  angle, so with ``rot`` the pair rotation ``(x0, x1) -> (-x1, x0)``:
  ``R(x) . m = (x * cos) . m + (x * sin) . (-rot(m))`` and
  ``sum_j R(x_j) v_j^T = sum_j (x_j * cos_j) v_j^T + rot_rows(sum_j (x_j * sin_j) v_j^T)``.
  So ``[phi * cos | phi * sin]`` (one buffer, two multiplications) meets a (4d, d) matrix in one
  GEMM on each side; the rotated feature tensors (a ``stack`` copy, two products and a sum each)
  are never made.
* **Scalars folded.** ``(phi_k N^-1/2)^T (v N^-1/2)`` becomes ``(phi_k^T v) / N`` on the small
  matrix.
* **Layout.** In inference the result is written directly in (B, N, h, d) memory order, so merging
  the heads afterwards is free.

This is the forward of the training Function :class:`linattn_mm.ops.nala.autograd.
NormAwareAttention` and of the inference forms. Results equal the reference up to float rounding
(tests: 1e-5 relative in float32, 1e-10 in float64, gradients included).
"""
import torch

from ..common import (add_or_take, backward_without_autocast, core_chunk_rows, core_dtype,
                      heads_buffer, into, numpy_log2_, sign_split, token_chunks, token_gram,
                      token_slice)
from ..constants import shape_constant
from .reference import apply_rope

__all__ = ['nala_forward', 'chunk_rows', 'TRAIN_CHUNK_ELEMENTS', 'key_matrix', 'rope_turn',
           'rope_turns', 'rotate_pairs', 'RotatePairs', 'RopeTables']


def rope_turn(sin, cos):
    """The RoPE angles as unit complex numbers ``cos + i sin``, one per channel pair: (N, d / 2)
    from the (N, d) tables, whose pairs share their angle (RoPE2d repeats each angle twice)."""
    return torch.complex(cos[..., ::2], sin[..., ::2])


def rope_turns(sin, cos):
    """``(turn, conj(turn))``: :func:`rope_turn` and its conjugate (the backward's turn), both
    made here, for callers that rotate many tensors by one table (a stage's layers: two
    operations for the stage instead of three for each layer's q and k)."""
    turn = rope_turn(sin, cos)
    return turn, turn.conj().resolve_conj()


class RopeTables(tuple):
    """``(sin, cos)`` of a 2-D RoPE for one grid (what ``RoPE2d`` returns), shared by the layers
    of a stage, which :func:`rotate_pairs` turns into the complex tables of :func:`rope_turns`
    once for all of them (per dtype and device of the tables it is given). Unpacks as the pair."""

    def __new__(cls, sin, cos):
        tables = super().__new__(cls, (sin, cos))
        tables._turns = {}
        return tables

    def __getnewargs__(self):  # copies and pickles: the tables, not the complex ones made of them
        return tuple(self)

    def __getstate__(self):
        return None

    def turns(self, sin, cos):
        """:func:`rope_turns` of ``sin, cos`` (these tables, maybe cast), made on the first call
        for their dtype and device."""
        # (tables made in inference mode are inference tensors: not to be kept by a training step)
        key = (sin.dtype, sin.device, torch.is_inference_mode_enabled())
        if key not in self._turns:
            self._turns[key] = rope_turns(sin, cos)
        return self._turns[key]


def _turn_pairs(x, turn):
    """The channel pairs of ``x`` (..., d) as complex numbers times ``turn`` (..., d / 2)."""
    if x.stride(-1) != 1 or x.storage_offset() % 2 or any(s % 2 for s in x.stride()[:-1]):
        x = x.clone(memory_format=torch.contiguous_format)  # pairs as complex numbers in memory
    return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * turn).flatten(-2)


class RotatePairs(torch.autograd.Function):
    """``x * cos + rotate_every_two(x) * sin`` (:func:`~linattn_mm.ops.nala.reference.apply_rope`)
    of ``x`` (..., N, d) as the complex product of each channel pair ``x0 + i x1`` with
    :func:`rope_turn`: ``(x0 cos - x1 sin, x1 cos + x0 sin)``, the reference's products and sums
    (equal to it bit for bit on CPU); the backward turns the gradient back by the conjugate. It
    keeps ``sin`` and ``cos`` (the stage's shared tables), not the complex table, and is two
    operations forward and three backward, where the reference's rotate-half takes five and seven
    (the softmax stages' training form). With ``turns`` (:func:`rope_turns`, made once for all
    the tensors a table rotates) it keeps the shared conjugate table instead: one operation each
    way."""

    @staticmethod
    def forward(ctx, x, sin, cos, turns=None):
        if turns is None:
            ctx.save_for_backward(sin, cos, None)
            return _turn_pairs(x, rope_turn(sin, cos))
        ctx.save_for_backward(None, None, turns[1])
        return _turn_pairs(x, turns[0])

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad):
        sin, cos, back = ctx.saved_tensors
        if back is None:
            back = rope_turn(sin, cos).conj()
        return _turn_pairs(grad, back), None, None, None


def rotate_pairs(x, sin, cos, shared=None):
    """The RoPE rotation of ``x`` through :class:`RotatePairs` for float32 / float64 ``x`` and
    tables of its dtype; other dtypes (torch has no bfloat16 complex numbers), and code that
    ``torch.compile`` traces (which fuses the rotate-half itself), through
    :func:`~linattn_mm.ops.nala.reference.apply_rope`. ``shared``: the :class:`RopeTables`
    ``sin, cos`` come from (maybe cast), whose complex tables are then made once for all the
    tensors it rotates."""
    if x.dtype not in (torch.float32, torch.float64) or sin.dtype != x.dtype \
            or cos.dtype != x.dtype or torch.compiler.is_compiling():
        return apply_rope(x, sin, cos)
    turns = shared.turns(sin, cos) if isinstance(shared, RopeTables) else None
    return RotatePairs.apply(x, sin, cos, turns)


def _rot_rows(m):
    """Row pairs ``(m[2i], m[2i+1]) -> (-m[2i+1], m[2i])`` of (..., R, c) (R even)."""
    m2 = m.unflatten(-2, (-1, 2))
    return torch.stack((-m2[..., 1, :], m2[..., 0, :]), dim=-2).flatten(-3, -2)


@shape_constant(maxsize=64)
def _fold_rows(D, device, dtype):
    """Row order and signs of :func:`rope_fold`'s second term: ``Q x = sign * x[order]``."""
    order = torch.arange(2 * D, device=device).view(2, -1, 2).flip(0, 2).flatten()
    sign = torch.tensor([-1., 1.], dtype=dtype, device=device).repeat(D)
    sign[D:] *= -1
    return order, sign.unsqueeze(-1)


def rope_fold(a, n):
    """``P a`` of ``a = [A_cos ; A_sin]`` (..., 2D, c), ``P = [[I, rot], [-rot, I]] / n`` with
    ``rot`` the row-pair turn of :func:`_rot_rows`: the key side's ``[M ; -rot(M)]``, ``M = (A_cos
    + rot(A_sin)) / n`` (``rot^2 = -I``); the backward's map from ``dW`` to ``dA`` is the same
    ``P``. ``P a = (a + Q a) / n`` with ``Q = [[0, rot], [-rot, 0]]`` a signed permutation of the
    rows: three operations for the eight of the steps written out, the same sums (bit for bit)."""
    order, sign = _fold_rows(a.shape[-2] // 2, a.device, a.dtype)
    return torch.addcmul(a, a.index_select(-2, order), sign).mul_(1.0 / n)


def _query_terms(q, power, query_power=None):
    """``||q||``, ``p = power * (0.5 + tanh(||q||))`` (or the constant ``query_power``),
    ``log2|q| - log2||q||`` and the signed
    ``c = sign(q) |d(q)|^p`` (no autograd graph). ``|d(q)|^p = 2^(p (log2|q| - log2||q||))``: no
    ``q / ||q||`` tensor and no ``pow`` with a per-token exponent (CPU exp2 is ~2.5x faster than
    exp); ``q = 0`` gives ``log2 0 = -inf`` and ``c = 0``, as ``d(0)^p = 0``."""
    qn = torch.linalg.vector_norm(q, dim=-1, keepdim=True)
    if query_power is None:
        p = torch.tanh(qn).add_(0.5).mul_(power)
    else:
        p = torch.full_like(qn, float(query_power))
    rel = numpy_log2_(q.abs()).sub_(numpy_log2_(qn.clamp_min(1e-12)))
    c = (rel * p).exp2_().copysign_(q)
    return qn, p, rel, c


def _query_features(q, power, query_power=None):
    """``[relu(d(q))^p, relu(-d(q))^p]`` (..., N, 2d), ``p = power * (0.5 + tanh(||q||))`` or the
    constant ``query_power``."""
    return sign_split(_query_terms(q, power, query_power)[-1])


def _key_power(k, power):
    """``k^lam`` with the sign of k kept (``k * k * k`` for ``lam = 3``)."""
    return k * k * k if power == 3 else k.abs().pow(power) * k.sign()


def _key_features(k, power):
    """``[relu(k^lam), relu(-k^lam)]`` (..., n, 2d)."""
    return sign_split(_key_power(k, power))


def _with_rope(f, sin, cos):
    """``[f * cos | f * sin]`` (..., N, 4d) of features f (..., N, 2d); sin/cos (N, d), broadcast
    over both halves of f (no repeated table)."""
    D, d = f.shape[-1], cos.shape[-1]
    out = torch.empty(*f.shape[:-1], 2 * D, dtype=f.dtype, device=f.device)
    f2 = f.unflatten(-1, (D // d, d))
    into(torch.mul, out[..., :D].unflatten(-1, (D // d, d)), f2, cos.unsqueeze(-2))
    into(torch.mul, out[..., D:].unflatten(-1, (D // d, d)), f2, sin.unsqueeze(-2))
    return out


def key_matrix(fk, v, sin, cos):
    """The small matrix the query features meet, from the key features ``fk`` (..., n, 2d): without
    the RoPE ``fk^T v / n`` (2d, d); with it ``[M ; -rot(M)]`` (4d, d), ``M = sum_j R(fk_j) v_j^T
    / n`` (the rotation folded: ``R(x) . m = (x cos) . m + (x sin) . (-rot(m))``)."""
    n = fk.shape[-2]
    if sin is None:
        return token_gram(fk, v).mul_(1.0 / n)
    wk = token_gram(_with_rope(fk, sin, cos), v)  # (4d, d)
    return rope_fold(wk, n)


#: elements of one (B, h, rows, d) chunk of q, k or v in the training form on CPU: rows =
#: ``TRAIN_CHUNK_ELEMENTS // (B h d)`` tokens, at least ``MIN_CHUNK_ROWS`` (the features of a
#: chunk are 2 or 4 times as wide)
TRAIN_CHUNK_ELEMENTS = 2 ** 16


def chunk_rows(q, rows=None):
    """Tokens per chunk of the training form for (B, h, N, d) tensors like ``q``
    (:func:`~linattn_mm.ops.common.core_chunk_rows` of :data:`TRAIN_CHUNK_ELEMENTS`: one chunk
    off CPU)."""
    return core_chunk_rows('nala_attention_fast', q, rows, TRAIN_CHUNK_ELEMENTS)


def nala_forward(q, k, v, power, eps, sin, cos, query_power=None, rows=None):
    """The kernel's computation without an autograd graph; returns the output (a (B, h, N, d) view
    of a (B, N, h, d) buffer), the key-side matrix (:func:`key_matrix`) and the mean key features
    (..., 2d) of the denominator. ``query_power``: a constant query exponent (None: norm-aware).
    It computes in :func:`~linattn_mm.ops.common.core_dtype` of q, k, v, which may come in a
    lower precision. ``rows``: tokens per chunk (:func:`chunk_rows`); in chunks the key pass sums
    the key-side products chunk by chunk and the query pass writes its chunk of the output, so
    that no full-size feature map is made."""
    work = core_dtype(q, k, v)
    N, n = q.shape[-2], k.shape[-2]
    step_q, step_k = chunk_rows(q, rows), chunk_rows(k, rows)
    if step_q >= N and step_k >= n:
        return _forward_whole(q.to(work), k.to(work), v.to(work), power, eps, sin, cos,
                              query_power)
    wk = ks = None
    for sl in token_chunks(n, step_k):
        fk = _key_features(k[:, :, sl].to(work), power)
        s = fk.sum(dim=-2)
        ks = add_or_take(ks, s)
        if sin is not None:
            fk = _with_rope(fk, token_slice(sin, sl, n), token_slice(cos, sl, n))
        wk = token_gram(fk, v[:, :, sl].to(work), acc=wk)
        del fk
    w = rope_fold(wk, n) if sin is not None else wk.mul_(1.0 / n)
    k_mean = ks.mul_(1.0 / n)
    out = heads_buffer(v, N, work)
    for sl in token_chunks(N, step_q):
        fq = _query_features(q[:, :, sl].to(work), power, query_power)
        den = fq @ k_mean.unsqueeze(-1)
        if sin is not None:
            fq = _with_rope(fq, token_slice(sin, sl, N), token_slice(cos, sl, N))
        into(torch.div, out[:, :, sl], fq @ w, den.add_(eps))
    return out, w, k_mean


def _forward_whole(q, k, v, power, eps, sin, cos, query_power):
    """:func:`nala_forward` in one chunk (q, k, v in the working dtype)."""
    fq = _query_features(q, power, query_power)
    fk = _key_features(k, power)
    k_mean = fk.mean(dim=-2)
    den = fq @ k_mean.unsqueeze(-1)  # (B, h, N, 1), unrotated features
    w = key_matrix(fk, v.to(fk.dtype), sin, cos)
    del fk
    if sin is not None:
        fq = _with_rope(fq, sin, cos)
    num = fq @ w
    B, h, N, d = num.shape
    out = torch.empty(B, N, h, d, dtype=num.dtype, device=num.device).transpose(1, 2)
    return into(torch.div, out, num, den.add_(eps)), w, k_mean
