"""PolaFormer's polarity-aware attention core in the official order of operations: the oracle of
every other implementation (``ZacharyMeng/PolaFormer``, ``models/pola_pvt.py``; paper Eq. 3-9 with
the official code's choices, see :mod:`linattn_mm.models.attentions.pola`)."""
import torch
import torch.nn.functional as F

__all__ = ['polarity_attention_reference', 'polarity_weights_reference']


def _features(q, k, p, temperature, k_bias):
    """``k + k_bias``, then ``q / s`` and ``k / s``, then the polarity maps."""
    if k_bias is not None:
        k = k + k_bias
    if temperature is not None:
        q, k = q / temperature, k / temperature
    q_pos, q_neg = F.relu(q) ** p, F.relu(-q) ** p
    kk = torch.cat([F.relu(k) ** p, F.relu(-k) ** p], dim=-1)
    return q_pos, q_neg, kk


def polarity_attention_reference(q, k, v, p, eps=1e-6, temperature=None, k_bias=None):
    """Polarity-aware linear attention on per-head tensors, as the official code computes it::

        k = k + k_bias;  q, k = q / s, k / s
        q_sim = [relu(q)^p, relu(-q)^p],  q_opp = [relu(-q)^p, relu(q)^p],  kk = [relu(k)^p, relu(-k)^p]
        x_sim = q_sim (kk^T n^-1/2)(v_s n^-1/2) / (q_sim . mean(kk) + eps)
        x_opp = q_opp (kk^T n^-1/2)(v_o n^-1/2) / (q_opp . mean(kk) + eps)

    Args:
        q (Tensor): queries (B, h, N, d).
        k (Tensor): keys (B, h, n, d).
        v (Tensor): values (B, h, n, d).
        p (Tensor): exponents broadcastable to (B, h, 1, d), all >= 1.
        eps (float): added to the denominators.
        temperature (Tensor, optional): ``s = softplus(scale)`` broadcastable to (1, h, 1, d); q and
            k are divided by it (after ``k_bias`` is added to k).
        k_bias (Tensor, optional): the position encoding added to k, broadcastable to k.

    Returns:
        Tensor: (B, h, N, d); channels ``[0, ceil(d/2))`` are the same-signed stream (on the first
        ``ceil(d/2)`` value channels), the rest the opposite-signed stream.
    """
    n = k.shape[-2]
    q_pos, q_neg, kk = _features(q, k, p, temperature, k_bias)
    q_sim = torch.cat([q_pos, q_neg], dim=-1)
    q_opp = torch.cat([q_neg, q_pos], dim=-1)
    v_sim, v_opp = v.chunk(2, dim=-1)
    k_mean = kk.mean(dim=-2, keepdim=True).transpose(-2, -1)  # (B, h, 2d, 1)
    kt = kk.transpose(-2, -1) * n ** -0.5
    z_sim = 1 / (q_sim @ k_mean + eps)
    x_sim = q_sim @ (kt @ (v_sim * n ** -0.5)) * z_sim
    z_opp = 1 / (q_opp @ k_mean + eps)
    x_opp = q_opp @ (kt @ (v_opp * n ** -0.5)) * z_opp
    return torch.cat([x_sim, x_opp], dim=-1)


def polarity_weights_reference(q, k, p, eps=1e-6, temperature=None, k_bias=None):
    """The token-to-token weights of the two streams, ``same`` and ``opposite`` (B, h, N, n):
    ``A_ij = phi(q_i) . phi(k_j) / n / (phi(q_i) . mean(kk) + eps)`` with ``phi(q) = q_sim`` or
    ``q_opp``; the core's streams are ``A v_s`` and ``A v_o``. Dense: for small inputs."""
    n = k.shape[-2]
    q_pos, q_neg, kk = _features(q, k, p, temperature, k_bias)
    k_mean = kk.mean(dim=-2, keepdim=True).transpose(-2, -1)
    out = {}
    for name, qf in (('same', torch.cat([q_pos, q_neg], -1)),
                     ('opposite', torch.cat([q_neg, q_pos], -1))):
        out[name] = (qf @ kk.transpose(-2, -1) / n) / (qf @ k_mean + eps)
    return out
