"""PolaFormer oracles."""
import torch
import torch.nn.functional as F


def polarity_attention_one_gemm(q, k, v, p, eps=1e-6):
    """The reference core's result with one query-side GEMM, from ``q_opp @ X == q_sim @ swap(X)``
    (swap exchanges the two d-row halves of X): with ``ksw = [k-, k+]``,
    ``kv = [kk^T v_s | ksw^T v_o] / n`` (2d x d) gives both streams from ``q_sim @ kv`` and the
    denominators are ``q_sim @ [mean(kk), mean(ksw)]``. The identity the fast kernel is built on."""
    n = k.shape[-2]
    q_sim = torch.cat([F.relu(q) ** p, F.relu(-q) ** p], dim=-1)
    k_pos, k_neg = F.relu(k) ** p, F.relu(-k) ** p
    kk = torch.cat([k_pos, k_neg], dim=-1)
    ksw = torch.cat([k_neg, k_pos], dim=-1)
    v_sim, v_opp = v.chunk(2, dim=-1)
    kv = torch.cat([kk.transpose(-2, -1) @ v_sim, ksw.transpose(-2, -1) @ v_opp], dim=-1) / n
    k_means = torch.stack([kk.mean(dim=-2), ksw.mean(dim=-2)], dim=-1)  # (B, h, 2d, 2)
    num = q_sim @ kv  # (B, h, N, d)
    den = q_sim @ k_means + eps  # (B, h, N, 2)
    d_s = v_sim.shape[-1]
    return torch.cat([num[..., :d_s] / den[..., :1], num[..., d_s:] / den[..., 1:]], dim=-1)
