"""NaLaFormer oracles."""
import torch
import torch.nn.functional as F


def nala_reference_core(q, k, v, lam=3., eps=1e-6, rope=None):
    """NaLa's official core written from the formulas (the reference of the NaLa kernel tests):
    phi_q = [relu(d(q))^p, relu(-d(q))^p] with d(q) = q / ||q|| and p = lam (0.5 + tanh ||q||),
    phi_k = [relu(k^lam), relu(-k^lam)] (sign of k kept), z from the unrotated maps, the 2-D RoPE
    ``rope = (sin, cos)`` on the numerator maps, ``n^-1/2`` on K and V."""
    from linattn_mm.ops.nala import apply_rope
    qn = q.norm(dim=-1, keepdim=True)
    dq = q / qn.clamp_min(1e-12)
    p = lam * (0.5 + torch.tanh(qn))
    kl = k.abs() ** lam * k.sign()
    phi_q = torch.cat([F.relu(dq) ** p, F.relu(-dq) ** p], -1)
    phi_k = torch.cat([F.relu(kl), F.relu(-kl)], -1)
    z = 1 / (phi_q @ phi_k.mean(-2, keepdim=True).transpose(-2, -1) + eps)
    if rope is not None:
        phi_q, phi_k = apply_rope(phi_q, *rope), apply_rope(phi_k, *rope)
    n = k.shape[-2]
    return phi_q @ ((phi_k.transpose(-2, -1) * n**-0.5) @ (v * n**-0.5)) * z
