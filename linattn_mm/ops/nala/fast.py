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

With a gradient needed, the same structure runs with out-of-place ops and ``pow`` (the gradient of
``exp(p log|x|)`` is NaN at 0). Results equal the reference up to float rounding (tests: 1e-5
relative in float32, 1e-10 in float64, gradients included).
"""
import torch

from ..common import grad_needed, numpy_log2_, sign_split

__all__ = ['nala_attention_fast']


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
    a = numpy_log2_(q.abs()).sub_(numpy_log2_(qn.clamp_min(1e-12))).mul_(p).exp2_()
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
