"""SeTformer: SeT attention (log-domain Sinkhorn self-transport), the SeTformer backbone, SeT in the
Swin / PVT skeletons, memory complexity and parameter counts."""
import math

import pytest
import torch
import torch.nn.functional as F

import linattn_mm  # noqa: F401,E402  (registers everything)
from oracles.shapes import assert_pyramid_outputs
from linattn_mm.models.attentions import build_attention
from linattn_mm.models.attentions.setformer import (SeTAttention, gaussian_kernel, log_sinkhorn,
                                                    nystrom_similarity, positional_log_kernel,
                                                    resize_refs, self_transport_attention,
                                                    setformer_cost, spherical_kmeans,
                                                    transport_plan)
from linattn_mm.registry import MODELS
from linattn_mm.utils import PeakMemoryCounter


def clustered_tokens(mod, N, noise=0.3, seed=0, dtype=torch.float32):
    """Tokens whose head slices lie near the module's references (sharp, hard-to-scale plans)."""
    g = torch.Generator().manual_seed(seed)
    h, m, d = mod.refs.shape
    refs = F.normalize(mod.refs.detach().to(dtype), dim=-1)
    idx = torch.randint(0, m, (N, ), generator=g)
    feats = refs[:, idx] + noise * torch.randn(h, N, d, generator=g, dtype=dtype) / math.sqrt(d)
    return feats.transpose(0, 1).reshape(1, N, h * d)


def rel_marginal_errors(plan, n, m):
    """max |n·T1 - 1| and max |m·Tᵀ1 - 1| (relative errors of the uniform marginals)."""
    rows = (plan.sum(-1) * n - 1).abs().max().item()
    cols = (plan.sum(-2) * m - 1).abs().max().item()
    return rows, cols


# ---------------------------------------------------------------------------------------------
# memory counter
# ---------------------------------------------------------------------------------------------
def test_peak_memory_counter_known_allocations():
    w = torch.randn(100, 100, requires_grad=True)
    with PeakMemoryCounter() as mem:
        a = torch.empty(1000, 1000)           # 4,000,000 bytes
        b = a.view(-1)                        # a view: same storage, not counted twice
        a.add_(1)                             # in place: nothing new
        assert mem.live_bytes == 4_000_000
        c = torch.ones(250, 1000)             # +1,000,000
        assert mem.peak_bytes == 5_000_000
        del a, b, c
        assert mem.live_bytes == 0
        x = torch.randn(64, 100)
        (x @ w).sum().backward()              # w.grad (40,000 B) + x (25,600 B) stay alive
    assert mem.peak_bytes == 5_000_000
    assert mem.live_bytes == 40_000 + 25_600


def test_peak_memory_counter_on_meta_tensors_counts_what_the_same_steps_keep():
    """``include_meta``: the shapes-only run of a computation has the peak and live bytes of the
    same computation on CPU; by default meta tensors are not counted."""
    def steps(device):
        w = torch.randn(100, 100, requires_grad=True, device=device)
        x = torch.randn(64, 100, device=device)
        t = torch.empty(1000, 1000, device=device)
        del t
        (x @ w).relu().sum().backward()
        return w

    peaks = {}
    for device, kw in (('cpu', {}), ('meta', dict(include_meta=True))):
        with PeakMemoryCounter(**kw) as mem:
            w = steps(device)
        peaks[device] = (mem.peak_bytes, mem.live_bytes)
        del w
    assert peaks['meta'] == peaks['cpu'] and peaks['cpu'][0] == 4_000_000 + 40_000 + 25_600
    with PeakMemoryCounter() as mem:
        steps('meta')
    assert mem.peak_bytes == 0


# ---------------------------------------------------------------------------------------------
# Sinkhorn
# ---------------------------------------------------------------------------------------------
def test_log_sinkhorn_marginals_and_custom_gradient():
    torch.manual_seed(0)
    n, m = 300, 120
    log_k = (torch.randn(2, 3, n, m) * 3).requires_grad_()
    row = torch.full((1, ), -math.log(n))
    col = torch.full((1, ), -math.log(m))
    f, g = log_sinkhorn(log_k, row, col, 30)
    T = transport_plan(log_k, f, g)
    r, c = rel_marginal_errors(T, n, m)
    assert r < 1e-4 and c < 1e-5, (r, c)
    # the custom log-sum-exp step (no per-iteration n×m tensor saved) gives autograd's gradients
    w = torch.randn_like(T)
    (T * w).sum().backward()
    lk = log_k.detach().clone().requires_grad_()
    g2 = torch.zeros(2, 3, m)
    for _ in range(30):
        f2 = row - torch.logsumexp(lk + g2[..., None, :], -1)
        g2 = col - torch.logsumexp(lk + f2[..., :, None], -2)
    ((lk + f2[..., :, None] + g2[..., None, :]).exp() * w).sum().backward()
    torch.testing.assert_close(log_k.grad, lk.grad, rtol=1e-4, atol=1e-7)


def test_log_sinkhorn_gradcheck_with_padding():
    torch.manual_seed(0)
    n, m = 7, 5
    log_k = torch.randn(2, n, m, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(2, n, dtype=torch.bool)
    pad[1, -3:] = True
    row = (-(~pad).sum(-1, keepdim=True).double().log()).expand(2, n).masked_fill(pad, -math.inf)
    col = torch.full((1, ), -math.log(m), dtype=torch.float64)

    def fn(lk):
        f, g = log_sinkhorn(lk, row, col, 6)
        return transport_plan(lk, f, g)

    assert torch.autograd.gradcheck(fn, (log_k, ))
    T = fn(log_k)
    assert (T[1, -3:] == 0).all()
    # the loop ends with the column update: columns exact after any number of iterations
    torch.testing.assert_close(T.sum(-2), torch.full((2, m), 1 / m, dtype=torch.float64))
    f, g = log_sinkhorn(log_k, row, col, 200)
    T = transport_plan(log_k, f, g)
    torch.testing.assert_close(T[1, :-3].sum(-1), torch.full((n - 3, ), 1 / (n - 3),
                                                              dtype=torch.float64))


@pytest.mark.parametrize('position', ['kernel', 'plan'])
@pytest.mark.parametrize('autocast', [False, True])
def test_module_plan_marginals_rows_and_grads(autocast, position):
    """Defaults (m=500, eps=0.1, tau=0.5, 30 iterations), in float32 and under bf16 autocast:
    float32 plan and output, attention rows sum to 1, gradients finite. With the positional term
    before Sinkhorn (``position='kernel'``, where the plan keeps its marginals) also: relative
    marginals within 1e-4 and the attention's columns summing to 1; the default ``'plan'`` takes
    the marginals away (tested against its formula below)."""
    torch.manual_seed(0)
    # defaults: num_refs=500, eps=0.1, num_iters=30, tau=0.5
    mod = SeTAttention(32, 2, position=position)
    x = clustered_tokens(mod, 256, noise=0.3)  # 16×16 grid
    ctx = torch.autocast('cpu', dtype=torch.bfloat16) if autocast else torch.autocast(
        'cpu', enabled=False)
    with ctx:
        T = mod.transport_plan(x.bfloat16() if autocast else x, (16, 16))
        assert T.dtype == torch.float32 and (T >= 0).all()
        if position == 'kernel':
            r, c = rel_marginal_errors(T, 256, 500)
            assert r < 1e-4 and c < 1e-4, (r, c)
        xg = x.clone().requires_grad_()
        y = mod(xg, (16, 16))
        assert y.dtype == torch.float32
        y.square().sum().backward()
    # the attention (the module's right-to-left product applied to the identity): non-negative,
    # rows sum to 1 (row normalisation), and with 'kernel' columns too (doubly stochastic:
    # marginals met)
    A = self_transport_attention(T[0], torch.eye(256).expand(2, 256, 256))
    assert (A >= 0).all()
    torch.testing.assert_close(A.sum(-1), torch.ones(2, 256), rtol=0, atol=1e-5)
    if position == 'kernel':
        torch.testing.assert_close(A.sum(-2), torch.ones(2, 256), rtol=0, atol=1e-3)
    assert torch.isfinite(xg.grad).all() and xg.grad.abs().sum() > 0
    for name, p in mod.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert mod.refs.grad.abs().sum() > 0


def test_default_position_multiplies_the_plan():
    """The default ``position='plan'`` (the paper's wording): Sinkhorn runs on the Gibbs kernel
    alone and its plan is then multiplied element-wise by M_ij = exp(-(i/n - j/m)²/τ)."""
    torch.manual_seed(0)
    mod = SeTAttention(16, 2, num_refs=6, num_iters=200).double()
    assert mod.position == 'plan' and mod.tau == 0.5
    bare = SeTAttention(16, 2, num_refs=6, num_iters=200, tau=None).double()
    bare.load_state_dict(mod.state_dict())
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    n, m = 12, 6
    i = torch.arange(n, dtype=torch.float64)[:, None] / n
    j = torch.arange(m, dtype=torch.float64)[None] / m
    M = torch.exp(-(i - j) ** 2 / 0.5)
    torch.testing.assert_close(mod.transport_plan(x, (3, 4)), bare.transport_plan(x, (3, 4)) * M,
                               rtol=1e-12, atol=1e-15)
    # the rows of the attention still sum to 1 (row normalisation); the columns no longer do
    A = mod.attention_weights(x, (3, 4))['weights']
    torch.testing.assert_close(A.sum(-1), torch.ones(2, 2, 12, dtype=torch.float64))


@pytest.mark.parametrize('position', ['kernel', 'plan'])
def test_padding_mask_finite_and_zero_mass(position):
    torch.manual_seed(0)
    mod = SeTAttention(16, 2, num_refs=20, position=position)
    x = torch.randn(3, 30, 16, requires_grad=True)
    pad = torch.zeros(3, 30, dtype=torch.bool)
    pad[1, 20:] = True
    pad[2] = True  # fully padded sample: zero attention output, no NaN
    T = mod.transport_plan(x, (5, 6), key_padding_mask=pad)
    assert (T[1, :, 20:] == 0).all()
    if position == 'kernel':  # the plan keeps its marginals
        r, c = rel_marginal_errors(T[1, :, :20], 20, 20)
        assert r < 1e-4 and c < 1e-4
    y = mod(x, (5, 6), key_padding_mask=pad)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y[1, 20:], mod.proj.bias.expand(10, 16))  # proj(0)
    torch.testing.assert_close(y[2], mod.proj.bias.expand(30, 16))
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[1, 20:] == 0).all()  # padded tokens influence nothing (value path masked)
    with pytest.raises(ValueError, match='key_padding_mask'):
        mod(x, (5, 6), key_padding_mask=pad[:, :10])


# ---------------------------------------------------------------------------------------------
# float64 block vs a dense implementation written from the formulas
# ---------------------------------------------------------------------------------------------
def dense_set(mod, x, hw, pad=None, iters=300):
    """Dense reference: n×m Gibbs kernel, plain (non-log) Sinkhorn loop, A = n·m·T Tᵀ (or the
    row-normalised T Tᵀ with the positional term on the plan), out = proj(A V)."""
    B, N, C = x.shape
    h, m, d = mod.refs.shape
    outs = []
    for b in range(B):
        heads = []
        valid = torch.ones(N, dtype=torch.bool) if pad is None else ~pad[b]
        n = int(valid.sum())
        for i in range(h):
            xi = x[b, :, i * d:(i + 1) * d]
            xn = xi / xi.norm(dim=-1, keepdim=True)
            yn = mod.refs[i] / mod.refs[i].norm(dim=-1, keepdim=True)
            S = torch.exp((xn @ yn.T - 1) / mod.sigma ** 2)
            K = torch.exp(S / mod.eps)
            M = torch.ones(N, m, dtype=x.dtype)
            if mod.tau is not None:
                H, W = hw
                for r in range(N):
                    for j in range(m):
                        M[r, j] = math.exp(-((r / (H * W)) - j / m) ** 2 / mod.tau)
            if mod.position in ('kernel', 'both'):
                K = K * M
            a = torch.where(valid, 1.0 / n, 0.0).to(x.dtype)
            bm = torch.full((m, ), 1.0 / m, dtype=x.dtype)
            u, v = torch.ones(N, dtype=x.dtype), torch.ones(m, dtype=x.dtype)
            for _ in range(iters):
                u = a / (K @ v)
                v = bm / (K.T @ u)
            T = u[:, None] * K * v[None, :]
            if mod.position in ('plan', 'both'):
                T = T * M
            A = T @ T.T
            if mod.row_normalize:
                A = A / A.sum(-1, keepdim=True).clamp_min(1e-300)
            else:
                A = n * m * A
            A = A * valid[:, None]
            V = (x[b] @ mod.v.weight.T + mod.v.bias)[:, i * d:(i + 1) * d]
            heads.append(A @ V)
        outs.append(torch.cat(heads, -1) @ mod.proj.weight.T + mod.proj.bias)
    return torch.stack(outs)


@pytest.mark.parametrize('cfg,masked', [
    (dict(tau=None), False),
    (dict(tau=0.5, position='kernel'), False),
    (dict(tau=0.8, eps=0.3, position='kernel'), True),
    (dict(tau=0.8, eps=0.3), True),  # the default position, 'plan'
    (dict(tau=0.5, position='plan'), False),
    (dict(tau=0.5, position='both'), True),
    (dict(tau=0.5, row_normalize=False, position='kernel'), True),
    (dict(tau=0.5, row_normalize=False), True),
])
def test_block_float64_matches_dense(cfg, masked):
    torch.manual_seed(0)
    hw = (3, 4)
    mod = SeTAttention(8, 2, num_refs=5, num_iters=300, **cfg).double()
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    pad = None
    if masked:
        pad = torch.zeros(2, 12, dtype=torch.bool)
        pad[1, 8:] = True
    out = mod(x, hw, key_padding_mask=pad)
    ref = dense_set(mod, x, hw, pad)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)


def test_nystrom_matches_direct_formula_and_gaussian_limit():
    torch.manual_seed(0)
    d, n, m, k = 16, 20, 7, 9
    x = F.normalize(torch.randn(n, d, dtype=torch.float64), dim=-1)
    y = F.normalize(torch.randn(m, d, dtype=torch.float64), dim=-1)
    z = F.normalize(torch.randn(k, d, dtype=torch.float64), dim=-1)
    sigma, reg = 0.5, 1e-3
    S = nystrom_similarity(x, y, z, sigma, reg)
    kzz = gaussian_kernel(z @ z.T, sigma) + reg * torch.eye(k, dtype=torch.float64)
    direct = gaussian_kernel(x @ z.T, sigma) @ torch.linalg.inv(kzz) @ gaussian_kernel(
        z @ y.T, sigma)
    torch.testing.assert_close(S, direct, rtol=1e-10, atol=1e-12)
    # anchors = the references themselves, no ridge: the Nyström kernel is exact at y
    S_exact = nystrom_similarity(x, y, y, sigma, 0.)
    torch.testing.assert_close(S_exact, gaussian_kernel(x @ y.T, sigma), rtol=1e-8, atol=1e-10)
    # the module's Nyström path trains (finite gradients on the anchors)
    mod = SeTAttention(16, 2, num_refs=6, kernel='nystrom', num_anchors=5)
    xx = torch.randn(2, 16, 16)
    mod(xx, (4, 4)).sum().backward()
    assert torch.isfinite(mod.anchors.grad).all() and mod.anchors.grad.abs().sum() > 0


def test_nystrom_values_match_the_papers_eq5():
    """``values='nystrom'``: the aggregated vectors are the paper's Nyström embeddings
    ``v(x_i) = κ(z, z)^-1/2 κ(z, x_i)`` (Eq. 5, symmetric inverse square root, here from scipy's
    fractional matrix power), the cost is ``<v(x_i), v(y_j)>``; float64 against a dense
    Sinkhorn and A = T Tᵀ / rows, written from the formulas."""
    from scipy.linalg import fractional_matrix_power
    torch.manual_seed(0)
    C, h, m, k, hw = 8, 2, 5, 3, (3, 4)
    N, d = hw[0] * hw[1], C // h
    mod = SeTAttention(C, h, num_refs=m, num_iters=300, eps=0.3, tau=0.8, kernel='nystrom',
                       num_anchors=k, values='nystrom', position='kernel').double()
    assert mod.v is None and mod.proj.in_features == h * k
    x = torch.randn(2, N, C, dtype=torch.float64)
    out = mod(x, hw)
    sig, reg = mod.sigma, mod.nystrom_reg
    kap = lambda t: torch.exp((t - 1) / sig**2)  # noqa: E731
    M = torch.tensor([[math.exp(-(i / N - j / m)**2 / mod.tau) for j in range(m)]
                      for i in range(N)], dtype=torch.float64)
    ref = []
    for b in range(2):
        heads = []
        for i in range(h):
            xn = F.normalize(x[b, :, i * d:(i + 1) * d], dim=-1)
            yn, zn = F.normalize(mod.refs[i], dim=-1), F.normalize(mod.anchors[i], dim=-1)
            kzz = (kap(zn @ zn.T) + reg * torch.eye(k, dtype=torch.float64)).detach().numpy()
            inv_sqrt = torch.from_numpy(fractional_matrix_power(kzz, -0.5).real)
            vx, vy = kap(xn @ zn.T) @ inv_sqrt, kap(yn @ zn.T) @ inv_sqrt
            K = torch.exp(vx @ vy.T / mod.eps) * M
            u, v = torch.ones(N, dtype=torch.float64), torch.ones(m, dtype=torch.float64)
            for _ in range(300):
                u = (1.0 / N) / (K @ v)
                v = (1.0 / m) / (K.T @ u)
            T = u[:, None] * K * v[None, :]
            A = T @ T.T
            heads.append((A / A.sum(-1, keepdim=True)) @ vx)
        ref.append(torch.cat(heads, -1) @ mod.proj.weight.T + mod.proj.bias)
    torch.testing.assert_close(out, torch.stack(ref).detach(), rtol=1e-9, atol=1e-10)
    # the cost is the Nyström kernel of the default path; it trains (finite anchor gradients)
    emb, emb_refs = mod.nystrom_values(F.normalize(x.view(2, N, h, d).transpose(1, 2), dim=-1))
    direct = nystrom_similarity(F.normalize(x.view(2, N, h, d).transpose(1, 2), dim=-1),
                                F.normalize(mod.refs, dim=-1)[None],
                                F.normalize(mod.anchors, dim=-1)[None], sig, reg)
    torch.testing.assert_close(emb @ emb_refs.transpose(-1, -2), direct, rtol=1e-9, atol=1e-12)
    mod.float()(x.float(), hw).sum().backward()
    assert torch.isfinite(mod.anchors.grad).all() and mod.anchors.grad.abs().sum() > 0
    # parameters: refs, anchors, proj (h·k -> C); no value projection
    assert sum(p.numel() for p in mod.parameters()) == h * m * d + h * k * d + h * k * C + C
    cost = setformer_cost(N, C, h, m, 30, kernel='nystrom', num_anchors=k, values='nystrom')
    assert cost['linear'] == N * h * k * C and cost['aggregate'] == 2 * h * N * m * (k + 1)
    from linattn_mm.flops import count_macs
    assert count_macs(mod, x[:1].float(), hw).total == cost['total']  # one image


def test_kmeans_init_reduces_cost_and_is_deterministic():
    torch.manual_seed(0)
    centres = F.normalize(torch.randn(2, 6, 8), dim=-1)
    pts = centres[:, torch.randint(0, 6, (300, ))] + 0.1 * torch.randn(2, 300, 8)
    _, cost0 = spherical_kmeans(pts, 6, num_iters=0, generator=torch.Generator().manual_seed(1))
    c1, cost1 = spherical_kmeans(pts, 6, num_iters=20, generator=torch.Generator().manual_seed(1))
    c2, _ = spherical_kmeans(pts, 6, num_iters=20, generator=torch.Generator().manual_seed(1))
    assert (cost1 < cost0).all()
    assert torch.equal(c1, c2)
    # the module: refs become unit centroids of the head slices; same seed -> same refs
    mod = SeTAttention(16, 2, num_refs=6, kernel='nystrom', num_anchors=4)
    feats = pts.transpose(0, 1).reshape(1, 300, 16)
    pn = F.normalize(pts, dim=-1)

    def within(refs):  # sum over points of 1 - max cosine to the references, per head
        return (1 - (pn @ F.normalize(refs, dim=-1).transpose(-1, -2)).amax(-1)).sum(-1)

    random_cost = within(mod.refs.detach())
    oracle_cost = within(centres)
    cost = mod.kmeans_init_(feats, generator=torch.Generator().manual_seed(3))
    refs = mod.refs.detach().clone()
    assert cost.shape == (2, ) and torch.allclose(refs.norm(dim=-1), torch.ones(2, 6))
    torch.testing.assert_close(cost, within(refs))
    assert (cost < 0.5 * random_cost).all()
    assert (cost < 2.0 * oracle_cost).all(), (cost, oracle_cost)
    mod.kmeans_init_(feats, generator=torch.Generator().manual_seed(3))
    assert torch.equal(mod.refs.detach(), refs)
    with pytest.raises(ValueError, match='cannot seed'):
        mod.kmeans_init_(feats[:, :4])


# ---------------------------------------------------------------------------------------------
# memory: O(N·m), independent of the iteration count, far below N×N
# ---------------------------------------------------------------------------------------------
def _peak(N, m, iters):
    torch.manual_seed(0)
    mod = SeTAttention(16, 1, num_refs=m, num_iters=iters)
    x = torch.randn(1, N, 16, requires_grad=True)
    with PeakMemoryCounter() as mem:
        mod(x, (N // 128, 128)).sum().backward()
    return mem.peak_bytes


def test_peak_memory_is_linear_in_tokens():
    m = 500
    unit = lambda n: n * m * 4  # noqa: E731  one float32 N×m plan of one head
    p16_a = _peak(16384, m, 2)
    p16_b = _peak(16384, m, 5)
    p8 = _peak(8192, m, 2)
    r16, r8 = p16_a / unit(16384), p8 / unit(8192)
    print(f'\nSeT peak (fwd+bwd, h=1, m=500): N=8192 {p8 / 2**20:.0f} MiB ({r8:.2f} N·m fp32), '
          f'N=16384 {p16_a / 2**20:.0f} MiB ({r16:.2f}), L=5: {p16_b / 2**20:.0f} MiB; '
          f'one N×N fp32: {16384**2 * 4 / 2**20:.0f} MiB')
    assert r16 < 8 and r8 < 8                     # a few N×m tensors
    assert abs(r16 / r8 - 1) < 0.05               # linear in N
    assert abs(p16_b / p16_a - 1) < 0.02          # Sinkhorn iterations cost no memory
    assert p16_a < 0.25 * 16384**2 * 4            # far below one N×N matrix


# ---------------------------------------------------------------------------------------------
# skeletons
# ---------------------------------------------------------------------------------------------
SMALL_ARCH = dict(embed_dims=16, depths=[1, 1, 2, 1], num_heads=[1, 2, 2, 4], mlp_ratio=2.)
SMALL_SET = dict(type='SeTAttention', num_refs=8, num_iters=5)


@pytest.mark.parametrize('size', [(64, 64), (67, 45), (33, 97)])
def test_setformer_shapes_any_size(size):
    model = MODELS.build(dict(type='SeTformer', arch=SMALL_ARCH, attn_cfg=SMALL_SET))
    assert_pyramid_outputs(model, size, [16, 32, 64, 128])


def test_setformer_mini_odd_size_and_training_options():
    model = MODELS.build(dict(type='SeTformer', arch='mini', out_indices=(1, 3)))
    torch.manual_seed(0)
    with torch.no_grad():
        outs = model.eval()(torch.randn(1, 3, 67, 45))
    assert [tuple(o.shape) for o in outs] == [(1, 128, 9, 6), (1, 512, 3, 2)]
    # with_cp gives the same gradients; frozen stages do not train
    torch.manual_seed(0)
    a = MODELS.build(dict(type='SeTformer', arch=SMALL_ARCH, attn_cfg=SMALL_SET,
                          drop_path_rate=0.))
    b = MODELS.build(dict(type='SeTformer', arch=SMALL_ARCH, attn_cfg=SMALL_SET,
                          drop_path_rate=0., with_cp=True, frozen_stages=1))
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 40, 40)
    sum(o.sum() for o in a(x)).backward()
    sum(o.sum() for o in b.train()(x)).backward()
    assert all(not p.requires_grad for p in b.patch_embed.parameters())
    assert all(not p.requires_grad for p in b.layers[0].parameters())
    ga = a.layers[2].blocks[0].attn.refs.grad
    torch.testing.assert_close(b.layers[2].blocks[0].attn.refs.grad, ga)


@pytest.mark.parametrize('skeleton,channels', [('LinAttnSwin', [96, 192, 384, 768]),
                                               ('LinAttnPVT', [64, 128, 320, 512])])
def test_set_in_swin_and_pvt(skeleton, channels):
    model = MODELS.build(dict(type=skeleton, arch='t', attn_cfg=SMALL_SET))
    sets = [m for m in model.modules() if isinstance(m, SeTAttention)]
    assert sets and all(m.num_refs == 8 for m in sets)
    assert_pyramid_outputs(model, (65, 63), channels)


def test_parameter_counts_vs_paper():
    """ImageNet classifiers (backbone with out_indices=(3,), its norm3, a 1000-way linear head).
    Paper (Table 1/2): M 16.2M, T 22.3M, S 35.0M, B 56.7M. Without the learnable references the
    NAT-width M/T reproduce the paper closely (16.39M / 22.71M); S/B do not (the paper's S/B
    cannot have NAT-S/B widths)."""
    paper = dict(m=16.2, t=22.3, s=35.0, b=56.7)
    pinned = dict(m=(18_785_704, 16_385_704), t=(26_643_880, 22_707_880),
                  s=(45_004_456, 39_100_456), b=(76_981_480, 69_109_480))
    lines = []
    for arch in 'mtsb':
        model = MODELS.build(dict(type='SeTformer', arch=arch, out_indices=(3, )))
        head = (model.embed_dims[-1] + 1) * 1000
        total = sum(p.numel() for p in model.parameters()) + head
        refs = sum(p.numel() for n, p in model.named_parameters() if n.endswith('.refs'))
        lines.append(f'SeTformer-{arch.upper()}: {total / 1e6:.2f}M ({(total - refs) / 1e6:.2f}M '
                     f'without refs), paper {paper[arch]}M')
        assert (total, total - refs) == pinned[arch]
    print('\n' + '\n'.join(lines))
    # refs_learnable=False: the references are buffers (K-means centroids), not parameters
    model = MODELS.build(dict(type='SeTformer', arch='m', out_indices=(3, ),
                              attn_cfg=dict(type='SeTAttention', refs_learnable=False)))
    assert sum(p.numel() for p in model.parameters()) + 513_000 == pinned['m'][1]
    assert any(k.endswith('attn.refs') for k in model.state_dict())


# the dense-prediction configs of the paper's Tables 4 / 5: backbone parameters (four output norms,
# no classifier head), references included (m = 750 COCO, 800 ADE20K; m·Σ depth_i·C_i of them)
DENSE_BACKBONE_PARAMS = {
    'mask-rcnn_setformer-m_fpn_ms-crop-3x_coco': 19_473_600,
    'mask-rcnn_setformer-t_fpn_ms-crop-3x_coco': 28_099_776,
    'mask-rcnn_setformer-s_fpn_ms-crop-3x_coco': 47_188_800,
    'mask-rcnn_setformer-b_fpn_ms-crop-3x_coco': 79_894_272,
    'upernet_setformer-m_8xb2-160k_ade20k-512x512': 19_713_600,
    'upernet_setformer-t_8xb2-160k_ade20k-512x512': 28_493_376,
    'upernet_setformer-s_8xb2-160k_ade20k-512x512': 47_779_200,
    'upernet_setformer-b_8xb2-160k_ade20k-512x512': 80_681_472,
}
# whole detector / segmentor (backbone, FPN / UperNet heads, 80 / 150 classes)
DENSE_MODEL_PARAMS = {
    'mask-rcnn_setformer-m_fpn_ms-crop-3x_coco': 39_624_624,
    'mask-rcnn_setformer-s_fpn_ms-crop-3x_coco': 67_462_704,
    'mask-rcnn_setformer-b_fpn_ms-crop-3x_coco': 100_291_056,
    'upernet_setformer-m_8xb2-160k_ade20k-512x512': 50_021_228,
    'upernet_setformer-s_8xb2-160k_ade20k-512x512': 80_200_364,
    'upernet_setformer-b_8xb2-160k_ade20k-512x512': 115_216_172,
}


def _dense_config(name):
    from linattn_mm.apis import get_config
    return get_config(f'configs/setformer/{name}.py')


@pytest.mark.parametrize('name', sorted(DENSE_BACKBONE_PARAMS))
def test_dense_config_backbone_params(name):
    """Backbone of each Mask R-CNN 3x / UperNet config: arch, SeT settings of the paper's task,
    pinned parameter count; without the references every size has the same count for both tasks
    (M 15.87M, T 22.20M, S 38.33M, B 68.09M)."""
    cfg = _dense_config(name)
    bb = dict(cfg.model.backbone)
    bb.pop('init_cfg')
    size = name.split('setformer-')[1][0]
    m, task = (750, 'coco') if 'coco' in name else (800, 'ade')
    assert bb['arch'] == size and bb['out_indices'] == (0, 1, 2, 3)
    assert dict(bb['attn_cfg']) == dict(type='SeTAttention', num_refs=m, eps=0.3, tau=0.8)
    assert bb['drop_path_rate'] == dict(m=0.2, t=0.2, s=0.3, b=0.5)[size]
    assert cfg.model.backbone.init_cfg.checkpoint == f'checkpoints/setformer_{size}.pth'
    with torch.device('meta'):
        model = MODELS.build(bb)
    widths = model.embed_dims
    heads = cfg.model.neck.in_channels if task == 'coco' else cfg.model.decode_head.in_channels
    assert list(heads) == widths
    if task == 'ade':
        assert cfg.model.auxiliary_head.in_channels == widths[2]
    total = sum(p.numel() for p in model.parameters())
    refs = sum(p.numel() for n, p in model.named_parameters() if n.endswith('.refs'))
    depths = model.arch_settings['depths']
    assert refs == m * sum(dep * w for dep, w in zip(depths, widths))
    assert total == DENSE_BACKBONE_PARAMS[name]
    assert total - refs == dict(m=15_873_600, t=22_195_776, s=38_332_800, b=68_086_272)[size]


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(DENSE_MODEL_PARAMS))
def test_dense_config_builds(name):
    """The whole detector / segmentor of each new size builds (no pretrained file needed) with a
    pinned parameter count and runs a small image."""
    from linattn_mm.apis import build_model
    torch.manual_seed(0)
    cfg = _dense_config(name)
    model = build_model(cfg, pretrained_backbone=False).eval()
    assert sum(p.numel() for p in model.parameters()) == DENSE_MODEL_PARAMS[name]
    with torch.no_grad():
        feats = model.extract_feat(torch.randn(1, 3, 64, 96))
    assert all(torch.isfinite(f).all() for f in feats)


def test_checkpoint_with_other_num_refs_loads(tmp_path):
    from linattn_mm.checkpoint import load_pretrained
    src = MODELS.build(dict(type='SeTformer', arch=SMALL_ARCH, attn_cfg=SMALL_SET))
    path = str(tmp_path / 'set.pth')
    torch.save(src.state_dict(), path)
    for m in (12, 5):
        cfg = dict(SMALL_SET, num_refs=m)
        dst = MODELS.build(dict(type='SeTformer', arch=SMALL_ARCH, attn_cfg=cfg))
        report = load_pretrained(dst, path)
        key = 'layers.0.blocks.0.attn.refs'
        assert report.resized[key] == ((1, 8, 16), (1, m, 16))
        if m > 8:  # the source references are kept
            torch.testing.assert_close(dst.state_dict()[key][:, :8], src.state_dict()[key])
    assert resize_refs(torch.randn(2, 8, 4), 8).shape == (2, 8, 4)


# ---------------------------------------------------------------------------------------------
# options and errors
# ---------------------------------------------------------------------------------------------
def test_options_extra_tokens_key_features_and_cost():
    torch.manual_seed(0)
    mod = build_attention(dict(type='SeTAttention', num_refs=6, cost_features='key'),
                          embed_dims=16, num_heads=2, num_extra_tokens=1, block_idx=3,
                          sr_ratio=8, qkv_bias=False)
    assert mod.k is not None and mod.v.bias is None
    y = mod(torch.randn(2, 1 + 12, 16), (3, 4))
    assert y.shape == (2, 13, 16) and torch.isfinite(y).all()
    lm = positional_log_kernel((3, 4), 6, 0.5, num_extra_tokens=1)
    assert lm.shape == (13, 6) and (lm[0] == 0).all() and (lm[1:] <= 0).all()
    cost = setformer_cost(3136, 64, 2, 500, 30)
    assert cost['total'] == 2 * 3136 * 64**2 + 3136 * 500 * 64 + 2 * 2 * 3136 * 500 * 33


@pytest.mark.parametrize('kwargs,match', [
    (dict(num_refs=0), 'num_refs'),
    (dict(eps=0.), 'eps'),
    (dict(num_iters=0), 'num_iters'),
    (dict(tau=-1.), 'tau'),
    (dict(position='after'), 'position'),
    (dict(kernel='laplace'), 'kernel'),
    (dict(sigma=0), 'sigma'),
    (dict(cost_features='query'), 'cost_features'),
    (dict(kernel='nystrom', num_anchors=0), 'num_anchors'),
    (dict(values='u'), 'values'),
    (dict(values='nystrom'), "values='nystrom'.*kernel='nystrom'"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SeTAttention(16, 2, **kwargs)


def test_bad_configs():
    with pytest.raises(TypeError, match='num_ref'):
        build_attention(dict(type='SeTAttention', num_ref=5), embed_dims=16, num_heads=2)
    with pytest.raises(ValueError, match='divisible'):
        SeTAttention(15, 2)
    with pytest.raises(KeyError, match='valid archs'):
        MODELS.build(dict(type='SeTformer', arch='huge'))
    with pytest.raises(ValueError, match='stages'):
        MODELS.build(dict(type='SeTformer', arch='t', attn_cfg=[SMALL_SET] * 3))
    with pytest.raises(ValueError, match='expected tokens'):
        SeTAttention(16, 2, num_refs=4)(torch.randn(1, 10, 16), (3, 4))
