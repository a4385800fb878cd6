"""Fast pure-torch kernel of NaLaFormer's norm-aware linear attention core (official kernel).

Same maths as :class:`linattn_mm.models.attentions.nala.NormAwareLinearAttention`'s reference
(``feature_maps`` + ``apply_rope`` in the official order of operations), reorganised so that fewer
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

With a gradient needed, the same structure runs with out-of-place ops and ``pow`` (the gradient of
``exp(p log|x|)`` is NaN at 0). Results equal the reference up to float rounding (tests: 1e-5
relative in float32, 1e-10 in float64, gradients included).
"""
import torch
import torch.nn.functional as F

from .common import chunked_layer_setup, grad_needed, linear_into, log2_, sign_split

__all__ = ['nala_attention_fast', 'nala_layer_chunked']


def _rot_rows(m):
    """Row pairs ``(m[2i], m[2i+1]) -> (-m[2i+1], m[2i])`` of (..., R, c) (R even)."""
    m2 = m.unflatten(-2, (-1, 2))
    return torch.stack((-m2[..., 1, :], m2[..., 0, :]), dim=-2).flatten(-3, -2)


def _query_features(q, power, grad):
    """``[relu(d(q))^p, relu(-d(q))^p]`` (..., N, 2d), ``p = power * (0.5 + tanh(||q||))``."""
    qn = torch.linalg.vector_norm(q, dim=-1, keepdim=True)
    p = power * (0.5 + torch.tanh(qn))
    if grad:
        dq = q / qn.clamp_min(1e-12)
        a = dq.abs().pow(p)
        pos = torch.relu(torch.copysign(a, q))
        return torch.cat([pos, a - pos], dim=-1)
    # 2^(p * (log2|q| - log2||q||)) (CPU exp2 is ~2.5x faster than exp); q = 0 -> log2 0 = -inf
    # -> 0, as d(0)^p = 0
    a = log2_(q.abs()).sub_(log2_(qn.clamp_min(1e-12))).mul_(p).exp2_()
    return sign_split(a.copysign_(q))


def _key_features(k, power, grad):
    """``[relu(k^lam), relu(-k^lam)]`` (..., n, 2d), the sign of k kept in ``k^lam``."""
    c = k * k * k if power == 3 else k.abs().pow(power) * k.sign()
    if grad:
        pos = torch.relu(c)
        return torch.cat([pos, pos - c], dim=-1)
    return sign_split(c)


def _with_rope(f, sin, cos, grad):
    """``[f * cos | f * sin]`` (..., N, 4d) of features f (..., N, 2d); sin/cos (N, d)."""
    c2, s2 = cos.repeat(1, 2), sin.repeat(1, 2)
    if grad:
        return torch.cat([f * c2, f * s2], dim=-1)
    D = f.shape[-1]
    out = torch.empty(*f.shape[:-1], 2 * D, dtype=f.dtype, device=f.device)
    torch.mul(f, c2, out=out[..., :D])
    torch.mul(f, s2, out=out[..., D:])
    return out


def nala_attention_fast(q, k, v, power=3., eps=1e-6, sin=None, cos=None):
    """Norm-aware linear attention core (official kernel), fast form.

    Args:
        q (Tensor): queries (B, h, N, d).
        k (Tensor): keys (B, h, N, d).
        v (Tensor): values (B, h, N, d).
        power (float): ``lam`` (key power, scale of the query power). Default 3.
        eps (float): added to the denominator.
        sin, cos (Tensor, optional): the 2-D RoPE (N, d) rotating the numerator features
            (pairs of channels share one angle, as :class:`RoPE2d` makes them); None: no RoPE.

    Returns:
        Tensor: (B, h, N, d): ``R(phi_q) (R(phi_k)^T v) / N / (phi_q . mean(phi_k) + eps)``; in
        inference a view of a (B, N, h, d) buffer.
    """
    grad = grad_needed(q, k, v, sin, cos)
    n = k.shape[-2]
    fq = _query_features(q, power, grad)
    fk = _key_features(k, power, grad)
    den = fq @ fk.mean(dim=-2).unsqueeze(-1)  # (B, h, N, 1), unrotated features
    v = v.to(fk.dtype)
    if sin is None:
        w = fk.transpose(-2, -1) @ v * (1.0 / n)  # (2d, d)
    else:
        D = fk.shape[-1]
        wk = _with_rope(fk, sin, cos, grad).transpose(-2, -1) @ v  # (4d, d)
        m = (wk[..., :D, :] + _rot_rows(wk[..., D:, :])) * (1.0 / n)  # sum_j R(phi_k_j) v_j^T
        w = torch.cat([m, -_rot_rows(m)], dim=-2)  # meets [phi_q * cos | phi_q * sin]
        fq = _with_rope(fq, sin, cos, grad)
    num = fq @ w
    if grad:
        return num / (den + eps)
    B, h, N, d = num.shape
    out = torch.empty(B, N, h, d, dtype=num.dtype, device=num.device).transpose(1, 2)
    return torch.div(num, den.add_(eps), out=out)


def _chunk_features(x, power, out, query, sin=None, cos=None):
    """Features of one chunk ``x`` (m, h, d) into ``out`` (m, h, 2d or 6d): ``[f+, f-]`` with
    ``f = |d(q)|^p`` signed (queries) or ``k^lam`` (keys), then with the RoPE ``[f * cos, f *
    sin]`` (sin, cos: (m, d), pairs of channels sharing an angle as :class:`RoPE2d` makes them)."""
    d = x.shape[-1]
    pos, neg = out[..., :d], out[..., d:2 * d]
    if query:  # 2^(p (log2|q| - log2||q||)), p = lam (0.5 + tanh ||q||); q = 0 -> 0
        qn = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        p = torch.tanh(qn).add_(0.5).mul_(power)
        a = log2_(torch.abs(x, out=neg)).sub_(log2_(qn.clamp_min_(1e-12))).mul_(p)
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
       (the RoPE of the numerator folded in, as in :func:`nala_attention_fast`).
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
