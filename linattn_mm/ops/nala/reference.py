"""NaLaFormer's norm-aware attention core in the official order of operations (the oracle of the
other implementations; ``ZacharyMeng/NaLaFormer``, ``NaLaformer/NALA.py``), and the paper's
cos/sin kernel (Eq. 12-17, App. A.2). The formulas and the paper-vs-code notes are in
:mod:`linattn_mm.models.attentions.nala`."""
import math

import torch
import torch.nn.functional as F

__all__ = ['rotate_every_two', 'apply_rope', 'query_power_of', 'nala_feature_maps',
           'nala_attention_reference', 'nala_weights_reference', 'KERNELS']

#: the two feature maps: the official code's ReLU sign split and the paper's cos/sin map
KERNELS = ('official', 'paper')


def rotate_every_two(x):
    """Pairs ``(x[2i], x[2i+1]) -> (-x[2i+1], x[2i])`` along the last dim."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope(x, sin, cos):
    """Rotate consecutive channel pairs of ``x`` (..., N, D) by the angles in ``sin``/``cos``
    (N, d); ``D`` may be a multiple of ``d`` (the same rotation is applied to each chunk of ``d``
    channels, e.g. the two halves of NaLa's 2d features)."""
    rep = x.shape[-1] // sin.shape[-1]
    if rep != 1:
        sin, cos = sin.repeat(1, rep), cos.repeat(1, rep)
    return x * cos + rotate_every_two(x) * sin


def query_power_of(qn, power, query_power=None):
    """The query exponent: the norm-aware ``p = power * (0.5 + tanh(||q||))`` (Eq. 8) of the norms
    ``qn``, or the constant ``query_power`` (the paper's Table 5 ablation rows) when it is given."""
    if query_power is None:
        return power * (0.5 + torch.tanh(qn))
    return torch.full_like(qn, float(query_power))


def nala_feature_maps(q, k, power=3., kernel='official', query_power=None):
    """Non-negative feature maps ``(phi_q, phi_k)``, each ``(..., N, 2d)``, of per-head ``q``,
    ``k`` ``(..., N, d)``::

        d(q) = q / ||q||,  p = power * (0.5 + tanh(||q||))   (or p = query_power, a constant)
        official: phi_q = [relu(d(q))^p, relu(-d(q))^p],  phi_k = [relu(k^lam), relu(-k^lam)]
        paper:    phi_q = |d(q)|^p [cos f(d(q)), sin f(d(q))],  phi_k = |k|^lam [cos f(d(k)), sin f(d(k))]

    with ``lam = power``, the sign of k kept in ``k^lam`` and ``f = pi/4 * tanh``; ``d(0) = 0``
    (the official code divides by ``||q||`` without an epsilon)."""
    lam = power
    qn = torch.linalg.vector_norm(q, dim=-1, keepdim=True)
    dq = q / qn.clamp_min(1e-12)
    p = query_power_of(qn, lam, query_power)
    if kernel == 'official':
        k = k.abs().pow(lam) * k.sign()  # k ** lam with the sign kept (= k**3 for lam = 3)
        phi_q = torch.cat([F.relu(dq).pow(p), F.relu(-dq).pow(p)], -1)
        phi_k = torch.cat([F.relu(k), F.relu(-k)], -1)
    elif kernel == 'paper':
        kn = torch.linalg.vector_norm(k, dim=-1, keepdim=True)
        dk = k / kn.clamp_min(1e-12)
        aq = (math.pi / 4) * torch.tanh(dq)
        ak = (math.pi / 4) * torch.tanh(dk)
        mq = dq.abs().pow(p)
        mk = k.abs().pow(lam)
        phi_q = torch.cat([mq * torch.cos(aq), mq * torch.sin(aq)], -1)
        phi_k = torch.cat([mk * torch.cos(ak), mk * torch.sin(ak)], -1)
    else:
        raise ValueError(f'nala_feature_maps: kernel must be one of {KERNELS}, got {kernel!r}')
    return phi_q, phi_k


def _maps(q, k, power, eps, sin, cos, kernel, query_power=None):
    """RoPE-rotated maps ``(R phi_q, R phi_k)`` and ``z = 1 / (phi_q . mean_j phi_k + eps)`` of the
    unrotated maps (the official code rotates the numerator only)."""
    phi_q, phi_k = nala_feature_maps(q, k, power, kernel, query_power)
    z = 1.0 / (phi_q @ phi_k.mean(dim=-2, keepdim=True).transpose(-2, -1) + eps)
    if sin is not None:
        phi_q, phi_k = apply_rope(phi_q, sin, cos), apply_rope(phi_k, sin, cos)
    return phi_q, phi_k, z


def nala_attention_reference(q, k, v, power=3., eps=1e-6, sin=None, cos=None, kernel='official',
                             query_power=None):
    """Norm-aware linear attention core::

        out = R(phi_q) ((R(phi_k)^T N^-1/2)(v N^-1/2)) / (phi_q . mean(phi_k) + eps)

    Args:
        q, k, v (Tensor): (B, h, N, d).
        power (float): ``lam``, the key power and the scale of the query power.
        eps (float): added to the denominator.
        sin, cos (Tensor, optional): the 2-D RoPE (N, d) on the numerator maps; None: no RoPE.
        kernel (str): ``'official'`` or ``'paper'`` (see :func:`nala_feature_maps`).
        query_power (float, optional): a constant query exponent instead of the norm-aware one.

    Returns:
        Tensor: (B, h, N, d).
    """
    N = q.shape[-2]
    phi_q, phi_k, z = _maps(q, k, power, eps, sin, cos, kernel, query_power)
    kv = (phi_k.transpose(-2, -1) * N ** -0.5) @ (v * N ** -0.5)  # (B, h, 2d, d)
    return (phi_q @ kv) * z


def nala_weights_reference(q, k, power=3., eps=1e-6, sin=None, cos=None, kernel='official',
                           query_power=None):
    """The (B, h, N, N) weights ``A_ij = <R phi(q_i), R phi(k_j)> / (N phi(q_i) . mean phi(k))`` of
    the core (``out = A v``). Dense: for small inputs."""
    phi_q, phi_k, z = _maps(q, k, power, eps, sin, cos, kernel, query_power)
    return (phi_q @ phi_k.transpose(-2, -1)) / q.shape[-2] * z
