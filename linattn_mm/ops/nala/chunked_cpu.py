"""The whole NaLa layer (official kernel) in CPU inference, a few thousand tokens at a time.

Used by the inference form that :func:`linattn_mm.deploy.convert` gives
:class:`~linattn_mm.models.attentions.nala.NormAwareLinearAttention` on CPU. The feature maps are
written into reused chunk buffers with the same sign split as :mod:`linattn_mm.ops.nala.fast`.
"""
import torch
import torch.nn.functional as F

from ..common import chunked_layer_setup, linear_into, numpy_log2_
from .fast import _rot_rows

__all__ = ['nala_layer_chunked', 'LAYER_CHUNK_ROWS', 'LAYER_CHUNK_ELEMENTS']


def _chunk_features(x, power, out, query, sin=None, cos=None):
    """Features of one chunk ``x`` (m, h, d) into ``out`` (m, h, 2d or 6d): ``[f+, f-]`` with
    ``f = |d(q)|^p`` signed (queries) or ``k^lam`` (keys), then with the RoPE ``[f * cos, f *
    sin]`` (sin, cos: (m, d), pairs of channels sharing an angle as :class:`RoPE2d` makes them)."""
    d = x.shape[-1]
    pos, neg = out[..., :d], out[..., d:2 * d]
    if query:  # 2^(p (log2|q| - log2||q||)), p = lam (0.5 + tanh ||q||); q = 0 -> 0
        qn = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        p = torch.tanh(qn).add_(0.5).mul_(power)
        a = numpy_log2_(torch.abs(x, out=neg)).sub_(numpy_log2_(qn.clamp_min_(1e-12))).mul_(p)
        a.exp2_().copysign_(x)
    elif power == 3:
        a = torch.mul(x, x, out=neg).mul_(x)
    else:
        a = torch.abs(x, out=neg).pow_(power).mul_(x.sign())
    torch.clamp_min(a, 0, out=pos)
    torch.sub(pos, a, out=neg)  # relu(a) - a == relu(-a), exactly
    if sin is not None:  # both signs times the token's cos / sin, broadcast (no repeated copy)
        f = out[..., :2 * d].unflatten(-1, (2, d))
        torch.mul(f, cos[:, None, None], out=out[..., 2 * d:4 * d].unflatten(-1, (2, d)))
        torch.mul(f, sin[:, None, None], out=out[..., 4 * d:].unflatten(-1, (2, d)))
    return out


#: tokens per chunk of :func:`nala_layer_chunked`; None: ``LAYER_CHUNK_ELEMENTS // C`` tokens (at
#: least 256)
LAYER_CHUNK_ROWS = None
#: tokens x channels per chunk (measured on CPU, one thread, fp32, NaLaFormer-T layers at 1024²
#: and 2048²: best near 1024 tokens at C = 64, 512 at C = 128 and 256 at C = 256-512, where the
#: query features are 6C wide; 4096 tokens at every width was 13-48 % slower)
LAYER_CHUNK_ELEMENTS = 2 ** 16


def nala_layer_chunked(x, w_q, b_q, w_kv, b_kv, w_g, b_g, lepe, ln_weight, ln_bias, ln_eps,
                       w_out, b_out, power, eps, sin, cos, num_heads, rows=None):
    """The whole NaLa layer (official kernel) in inference, ``rows`` tokens of one image at a time
    (CPU): ``out_proj(LN(core(q, k, v) + LePE(v)) * SiLU(g))``.

    Two passes over the tokens of each image, with small reused buffers instead of the (N, 4C)
    projection and the (N, 4d)-per-head feature tensors:

    1. keys: ``[k | v] = x W_kv^T + b``; ``k^lam`` with the sign split; ``v`` is kept for the LePE
       conv. Accumulated over the chunks: ``[f * cos | f * sin]^T v`` (4d x d per head, ``f =
       [k+, k-]``) and ``sum f``. After the pass they become the (6d, d + 1) matrix the query
       features meet: ``[0 | sum f / N ; M, -rot(M) | 0]`` with ``M = (A_cos + rot(A_sin)) / N``
       (the RoPE of the numerator folded in, as in
       :func:`~linattn_mm.ops.nala.fast.nala_attention_fast`).
    2. queries: ``q`` and its norm-dependent power, the buffer ``[f_q, f_q * cos, f_q * sin]``
       (6d per head); the numerator is ``[f_q * cos, f_q * sin]`` against the (4d, d) block and
       the denominator ``f_q`` against the (2d, 1) block (two GEMMs that skip the zero blocks:
       7-12 % faster per layer than one GEMM against the whole matrix); then the division,
       ``+ LePE(v)``, the LayerNorm, ``* SiLU(g)`` and ``out_proj`` written into the result.
       Without the RoPE, ``f_q`` (2d) meets the (2d, d + 1) matrix ``[M | sum f / N]`` in one
       GEMM.

    Same operations as the fast core and the module's gate up to the order of the sums over tokens.

    Args:
        x (Tensor): tokens (B, N, C), float32 / float64, CPU.
        w_q, b_q, w_g, b_g (Tensor): query and gate projections (C, C), (C, ) (biases optional).
        w_kv, b_kv (Tensor): key / value projection (2C, C), keys first.
        lepe (callable): ``v`` (B, N, C) -> the LePE conv term (B, N, C).
        ln_weight, ln_bias (Tensor), ln_eps (float): the output LayerNorm over C.
        w_out, b_out (Tensor): ``out_proj`` (C, C), (C, ).
        power (float): ``lam``. eps (float): added to the denominator.
        sin, cos (Tensor | None): the 2-D RoPE (N, d), or None for none.
        num_heads (int): heads h (head dim ``d = C / h``, even with the RoPE).
        rows (int, optional): tokens per chunk, default :data:`LAYER_CHUNK_ROWS` or, when that is
            None, :data:`LAYER_CHUNK_ELEMENTS` ``// C``.

    Returns:
        Tensor: (B, N, C).
    """
    B, N, C, d, rows = chunked_layer_setup('nala_layer_chunked', x, num_heads, rows,
                                           LAYER_CHUNK_ROWS, LAYER_CHUNK_ELEMENTS,
                                           sin is not None, w_q, w_kv, w_g, w_out, ln_weight,
                                           sin, cos)
    h = num_heads
    rope = sin is not None
    F_ = 6 * d if rope else 2 * d  # query / key feature width per head
    new = x.new_empty

    # pass 1: keys and values
    v = new(B, N, C)
    kv_buf = new(rows, 2 * C)
    kf_buf = new(rows, h, F_)
    w_ext = new(B, h, F_, d + 1)
    acc = new(h, 4 * d if rope else 2 * d, d)
    ks = new(h, 2 * d)
    for b in range(B):
        acc.zero_()
        ks.zero_()
        for s in range(0, N, rows):
            m = min(rows, N - s)
            kv = linear_into(x[b, s:s + m], w_kv, b_kv, kv_buf[:m])
            v[b, s:s + m] = kv[:, C:]
            kf = _chunk_features(kv[:, :C].view(m, h, d), power, kf_buf[:m], False,
                                 None if sin is None else sin[s:s + m],
                                 None if cos is None else cos[s:s + m])
            lo = 2 * d if rope else 0
            torch.baddbmm(acc, kf[..., lo:].permute(1, 2, 0),
                          v[b, s:s + m].view(m, h, d).transpose(0, 1), out=acc)
            ks.add_(kf[..., :2 * d].sum(0))
        w = w_ext[b]
        w.zero_()
        w[:, :2 * d, d] = ks * (1.0 / N)
        if rope:
            D = 2 * d
            rot = (acc[:, :D] + _rot_rows(acc[:, D:])) * (1.0 / N)  # sum_j R(f_k_j) v_j^T / N
            w[:, 2 * d:4 * d, :d] = rot
            w[:, 4 * d:, :d] = -_rot_rows(rot)
        else:
            w[:, :2 * d, :d] = acc * (1.0 / N)
    conv = lepe(v)
    del v
    # pass 2: queries, gate, output
    out = new(B, N, C)
    q_buf, g_buf, o_buf = new(rows, C), new(rows, C), new(rows, C)
    r_buf = new(h, rows, d + 1)
    for b in range(B):
        for s in range(0, N, rows):
            m = min(rows, N - s)
            xs = x[b, s:s + m]
            qf = _chunk_features(linear_into(xs, w_q, b_q, q_buf[:m]).view(m, h, d), power,
                                 kf_buf[:m], True, None if sin is None else sin[s:s + m],
                                 None if cos is None else cos[s:s + m])
            o = o_buf[:m]
            if rope:  # numerator [f*cos | f*sin] (4d) and denominator f (2d): no zero blocks
                qt = qf.transpose(0, 1)
                r = torch.bmm(qt[..., 2 * d:], w_ext[b, :, 2 * d:, :d], out=r_buf[:, :m, :d])
                z = torch.bmm(qt[..., :2 * d], w_ext[b, :, :2 * d, d:], out=r_buf[:, :m, d:])
                torch.div(r, z.add_(eps), out=o.view(m, h, d).transpose(0, 1))
            else:
                r = torch.bmm(qf.transpose(0, 1), w_ext[b], out=r_buf[:, :m])  # (h, m, d + 1)
                torch.div(r[..., :d], r[..., d:].add_(eps), out=o.view(m, h, d).transpose(0, 1))
            o.add_(conv[b, s:s + m])
            o = F.layer_norm(o, (C, ), ln_weight, ln_bias, ln_eps)
            o.mul_(F.silu(linear_into(xs, w_g, b_g, g_buf[:m]), inplace=True))
            linear_into(o, w_out, b_out, out[b, s:s + m])
    return out
