"""Kernels of SeT, the self-optimal-transport attention of SeTformer: the kernel similarity of
tokens and references (exact Gaussian or Nyström), the positional log-kernel, log-domain Sinkhorn
(with a log-sum-exp step whose backward keeps no per-iteration n x m tensor), the transport plan,
the rank-m self-kernel attention applied right to left, and spherical K-means for the references.
The fast form of the Sinkhorn loop (scaling domain, an autograd Function) is in
:mod:`linattn_mm.ops.setformer.autograd`.
The formulas and the paper-vs-reading notes are in :mod:`linattn_mm.models.attentions.setformer`."""
import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from ..common import backward_without_autocast

__all__ = ['gaussian_kernel', 'nystrom_similarity', 'nystrom_inv_sqrt', 'nystrom_embedding',
           'positional_log_kernel',
           'log_sinkhorn', 'transport_plan', 'self_transport_attention', 'self_transport_terms',
           'spherical_kmeans']


def gaussian_kernel(t, sigma):
    """κ(t) = exp((t - 1) / σ²) of cosine similarities t (the Gaussian kernel on the unit sphere:
    exp(-‖x̂ - ŷ‖² / (2σ²)) = κ(<x̂, ŷ>)). Values in [exp(-2/σ²), 1]."""
    return torch.exp((t - 1.) / (sigma * sigma))


def nystrom_similarity(x_hat, y_hat, z_hat, sigma, reg=1e-3):
    """Nyström approximation of the Gaussian kernel through anchors ``z``:
    ``S = κ(x̂ ẑᵀ) (κ(ẑ ẑᵀ) + reg·I)^-1 κ(ẑ ŷᵀ)``.

    The paper's features are ``v(x) = κ(ZZᵀ)^-1/2 κ(Z x)``; here the symmetric inverse square root
    is replaced by the (equivalent for the similarities, better conditioned for gradients) inverse
    Cholesky factor: ``v(x) = L^-1 κ(Z x)`` with ``L Lᵀ = κ(ZZᵀ) + reg·I``, so ``<v(x), v(y)>`` is
    the same.

    Args:
        x_hat (Tensor): (..., n, d) unit vectors. y_hat (Tensor): (..., m, d) unit vectors.
        z_hat (Tensor): (..., k, d) unit anchors (broadcast against x_hat / y_hat).
        sigma (float): Gaussian bandwidth. reg (float): ridge added to κ(ZZᵀ).

    Returns:
        Tensor (..., n, m).
    """
    k = z_hat.shape[-2]
    kzz = gaussian_kernel(z_hat @ z_hat.transpose(-1, -2), sigma)
    kzz = kzz + reg * torch.eye(k, dtype=kzz.dtype, device=kzz.device)
    chol = torch.linalg.cholesky(kzz)  # (..., k, k), lower
    # v = L^-1 κ(Z x) as rows: solve L vᵀ = κ(Z x)ᵀ
    fx = gaussian_kernel(x_hat @ z_hat.transpose(-1, -2), sigma)  # (..., n, k)
    fy = gaussian_kernel(y_hat @ z_hat.transpose(-1, -2), sigma)  # (..., m, k)
    vx = torch.linalg.solve_triangular(chol, fx.transpose(-1, -2), upper=False)  # (..., k, n)
    vy = torch.linalg.solve_triangular(chol, fy.transpose(-1, -2), upper=False)  # (..., k, m)
    return vx.transpose(-1, -2) @ vy


def nystrom_inv_sqrt(z_hat, sigma, reg=1e-3):
    """``(κ(z, z) + reg·I)^-1/2`` (..., k, k), the symmetric inverse square root through an
    eigendecomposition (as the CKN / OTK code). Its gradient is undefined where κ(z, z) has
    repeated eigenvalues (e.g. duplicate anchors)."""
    k = z_hat.shape[-2]
    kzz = gaussian_kernel(z_hat @ z_hat.transpose(-1, -2), sigma)
    kzz = kzz + reg * torch.eye(k, dtype=kzz.dtype, device=kzz.device)
    lam, vec = torch.linalg.eigh(kzz)
    lam = lam.clamp_min(reg if reg > 0 else torch.finfo(lam.dtype).eps)
    return (vec * lam.rsqrt().unsqueeze(-2)) @ vec.transpose(-1, -2)  # U Λ^-1/2 Uᵀ


def nystrom_embedding(x_hat, z_hat, sigma, reg=1e-3, inv_sqrt=None):
    """The paper's Nyström embedding (§"Projecting onto a linear subspace"), as rows:
    ``v(x_i) = κ(z, z)^-1/2 κ(z, x_i)`` with ``κ(z, z) + reg·I`` and its **symmetric** inverse
    square root (:func:`nystrom_inv_sqrt`), so ``<v(x), v(y)>`` is the Nyström kernel of
    :func:`nystrom_similarity` and ``v`` itself is the paper's vector, not a rotation of it (the
    inverse Cholesky factor of :func:`nystrom_similarity` gives the same inner products but
    rotated vectors).

    Args:
        x_hat (Tensor): (..., n, d) unit vectors. z_hat (Tensor): (..., k, d) unit anchors
            (broadcast against x_hat). sigma (float): Gaussian bandwidth. reg (float): ridge.
        inv_sqrt (Tensor, optional): :func:`nystrom_inv_sqrt` of ``z_hat``, when already computed.

    Returns:
        Tensor (..., n, k).
    """
    if inv_sqrt is None:
        inv_sqrt = nystrom_inv_sqrt(z_hat, sigma, reg)
    return gaussian_kernel(x_hat @ z_hat.transpose(-1, -2), sigma) @ inv_sqrt


def positional_log_kernel(hw_shape, num_refs, tau, num_extra_tokens=0, device=None,
                          dtype=torch.float32):
    """log M with ``M_ij = exp(-(i/n - j/m)² / tau)`` (paper §SeT, "linear positional encoding").

    ``i`` is the row-major (raster) index of a grid token, ``n = H·W``, ``j`` the reference index,
    both 0-based. Extra (class) tokens have no position: their rows are 0 (M = 1). The paper
    multiplies the plan by M after Sinkhorn (``position='plan'``, the default); ``'kernel'`` adds
    log M to the log Gibbs kernel before it (reading [3] in
    :mod:`linattn_mm.models.attentions.setformer`).

    Returns:
        Tensor (num_extra_tokens + H·W, num_refs).
    """
    H, W = hw_shape
    n = H * W
    pi = torch.arange(n, device=device, dtype=dtype) / n
    pj = torch.arange(num_refs, device=device, dtype=dtype) / num_refs
    log_m = -(pi[:, None] - pj[None, :]).square() / tau
    if num_extra_tokens:
        log_m = torch.cat([log_m.new_zeros(num_extra_tokens, num_refs), log_m], 0)
    return log_m


class _LseStep(torch.autograd.Function):
    """``logsumexp(log_k + pot, dim)`` where ``pot`` is broadcast along the reduced dimension's
    complement: ``dim=-1`` (row step) takes ``pot`` of shape (..., m), ``dim=-2`` (column step)
    ``pot`` of shape (..., n). Saves only ``log_k`` (shared by every step of the loop), ``pot`` and
    the result; the backward recomputes the soft-max, so an unrolled L-step loop keeps O(n·m + L·(n
    + m)) memory instead of O(L·n·m)."""

    @staticmethod
    def forward(ctx, log_k, pot, dim):
        z = log_k + (pot.unsqueeze(-2) if dim == -1 else pot.unsqueeze(-1))
        out = torch.logsumexp(z, dim=dim)
        ctx.dim = dim
        ctx.save_for_backward(log_k, pot, out)
        return out

    @staticmethod
    @once_differentiable
    @backward_without_autocast
    def backward(ctx, grad_out):
        log_k, pot, out = ctx.saved_tensors
        if ctx.dim == -1:
            p = log_k + pot.unsqueeze(-2)
            p.sub_(out.unsqueeze(-1)).exp_().mul_(grad_out.unsqueeze(-1))
            grad_pot = p.sum(-2)
        else:
            p = log_k + pot.unsqueeze(-1)
            p.sub_(out.unsqueeze(-2)).exp_().mul_(grad_out.unsqueeze(-2))
            grad_pot = p.sum(-1)
        grad_k = p if ctx.needs_input_grad[0] else None
        if grad_k is not None and grad_k.shape != log_k.shape:  # log_k was broadcast
            grad_k = grad_k.sum_to_size(log_k.shape)
        if grad_pot.shape != pot.shape:
            grad_pot = grad_pot.sum_to_size(pot.shape)
        return grad_k, (grad_pot if ctx.needs_input_grad[1] else None), None


def _lse_step(log_k, pot, dim):
    if torch.is_grad_enabled() and (log_k.requires_grad or pot.requires_grad):
        return _LseStep.apply(log_k, pot, dim)
    z = log_k + (pot.unsqueeze(-2) if dim == -1 else pot.unsqueeze(-1))
    return torch.logsumexp(z, dim=dim)


def log_sinkhorn(log_k, row_log_marginal, col_log_marginal, num_iters):
    """Log-domain Sinkhorn matrix scaling with uniform (or masked) marginals.

    Finds potentials ``f`` (..., n), ``g`` (..., m) such that ``T = exp(log_k + f ⊕ g)`` has row
    sums ``exp(row_log_marginal)`` and column sums ``exp(col_log_marginal)``. Each iteration is a
    row update then a column update (both O(n·m)); the loop **ends with the column update**, so
    the column marginals are exact (to rounding) and the row marginals carry the remaining error.

    Args:
        log_k (Tensor): (..., n, m) log Gibbs kernel (``-C / eps``, plus a log positional term).
        row_log_marginal (Tensor): (..., n), broadcastable; ``-inf`` rows (padding) get no mass.
        col_log_marginal (Tensor): (..., m), broadcastable.
        num_iters (int): number of (row, column) iterations, >= 1.

    Returns:
        tuple[Tensor, Tensor]: ``f`` (..., n) and ``g`` (..., m).
    """
    if num_iters < 1:
        raise ValueError(f'log_sinkhorn: num_iters must be >= 1, got {num_iters}')
    batch = log_k.shape[:-2]
    g = log_k.new_zeros(batch + log_k.shape[-1:])
    f = None
    for _ in range(num_iters):
        f = row_log_marginal - _lse_step(log_k, g, -1)
        g = col_log_marginal - _lse_step(log_k, f, -2)
    return f, g


def transport_plan(log_k, f, g, log_plan_extra=None):
    """``T = exp(log_k + f ⊕ g [+ log_plan_extra])`` (the positional term applied on the plan for
    ``position='plan'``/``'both'``)."""
    z = log_k + f.unsqueeze(-1) + g.unsqueeze(-2)
    if log_plan_extra is not None:
        z = z + log_plan_extra
    return z.exp()


def self_transport_attention(plan, v, row_normalize=True, scale=None, valid=None):
    """Apply the rank-m self-kernel attention ``A = c·T Tᵀ`` to values without forming it.

    ``out = T (Tᵀ [V, 1])`` in one right-to-left pass (O(n·m·d)); the extra ones column gives the
    row sums ``r = T (Tᵀ 1)`` of ``T Tᵀ``. The paper's Eq. 3 output ``√m · Tᵀ u(x)`` has m rows; the n
    output tokens come from Eq. 4's self-kernel ``T_y = m · T Tᵀ`` (reading [1] in
    :mod:`linattn_mm.models.attentions.setformer`).

    Args:
        plan (Tensor): (..., n, m) transport plan T.
        v (Tensor): (..., n, d) values.
        row_normalize (bool): divide by ``r`` (rows of the attention sum to 1 exactly; equals the
            constant ``c = n·m`` when the Sinkhorn marginals are exact). False: multiply by
            ``scale``.
        scale (Tensor | float): the constant ``c`` (e.g. ``n_valid·m``) when not row-normalising.
        valid (Tensor, optional): (..., n, 1) bool, False for padded rows (their output is 0).

    Returns:
        Tensor (..., n, d).
    """
    return self_transport_terms(plan, v, row_normalize, scale, valid)[0]


def self_transport_terms(plan, v, row_normalize=True, scale=None, valid=None):
    """:func:`self_transport_attention` and its intermediate terms (for a backward written by
    hand): ``(out, z, num, den)`` with ``z = Tᵀ [V, 1]`` (..., m, d + 1), ``[num, den] = T z``
    (``den`` set to 1 on padded rows when row-normalising)."""
    v1 = torch.cat([v, v.new_ones(v.shape[:-1] + (1, ))], dim=-1)
    z = plan.transpose(-1, -2) @ v1
    o = plan @ z
    num, den = o[..., :-1], o[..., -1:]
    if row_normalize:
        if valid is not None:
            den = torch.where(valid, den, torch.ones_like(den))
        out = num / den
    else:
        out = num * scale
    if valid is not None:
        out = out.masked_fill(~valid, 0.)
    return out, z, num, den


@torch.no_grad()
def spherical_kmeans(points, num_clusters, num_iters=20, generator=None):
    """Spherical K-means (cosine similarity) of ``points`` (..., P, d) into ``num_clusters`` unit
    centroids, independently for each leading index (e.g. each head). Initialisation: k-means++
    seeding (D² sampling with the cosine distance) drawn with ``generator`` (deterministic given
    its seed); an empty cluster keeps its previous centroid.

    Returns:
        tuple[Tensor, Tensor]: centroids (..., K, d) (unit norm) and the final within-cluster
        cost ``sum_p (1 - max_k <p̂, c_k>)`` (...,).
    """
    pts = nn.functional.normalize(points.float(), dim=-1)
    lead, P, d = pts.shape[:-2], pts.shape[-2], pts.shape[-1]
    if P < num_clusters:
        raise ValueError(f'spherical_kmeans: {P} points cannot seed {num_clusters} clusters; '
                         f'use more tokens (batch or image size)')
    flat = pts.reshape(-1, P, d)
    cents = []
    for i in range(flat.shape[0]):  # k-means++ seeding (D² sampling with the cosine distance)
        first = torch.randint(P, (1, ), generator=generator).item()
        chosen = [first]
        best = flat[i] @ flat[i, first]
        for _ in range(num_clusters - 1):
            w = (1 - best).clamp_min(0).cpu().double() + 1e-12
            nxt = torch.multinomial(w, 1, generator=generator).item()
            chosen.append(nxt)
            best = torch.maximum(best, flat[i] @ flat[i, nxt])
        cents.append(flat[i, chosen])
    cent = torch.stack(cents)  # (G, K, d)
    for _ in range(num_iters):
        assign = (flat @ cent.transpose(-1, -2)).argmax(-1)  # (G, P)
        sums = torch.zeros_like(cent).scatter_add_(
            1, assign.unsqueeze(-1).expand(-1, -1, d), flat)
        norm = sums.norm(dim=-1, keepdim=True)
        cent = torch.where(norm > 0, sums / norm.clamp_min(1e-12), cent)
    cost = (1 - (flat @ cent.transpose(-1, -2)).amax(-1)).sum(-1)
    return cent.reshape(lead + (num_clusters, d)), cost.reshape(lead)
