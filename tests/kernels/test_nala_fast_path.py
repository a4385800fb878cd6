"""NaLa fast path (:func:`linattn_mm.ops.nala.nala_attention_fast`) against the reference core of
:class:`NormAwareLinearAttention` (``feature_maps`` + ``apply_rope`` in the official order of
operations, written out in tests/oracles/nala.py from the module docstring's formulas): the kernel,
the module with ``core='fast'`` (the default) against ``core='reference'``, and a whole NaLaFormer
backbone, outputs and gradients, in float32 (1e-5 relative) and float64 (1e-10 relative)."""
import pytest
import torch

from linattn_mm import deploy
from linattn_mm.models.attentions import build_attention
from linattn_mm.models.attentions.nala import NormAwareLinearAttention, RoPE2d
from linattn_mm.models.backbones.nalaformer import NaLaFormer
from linattn_mm.ops.nala import nala_attention_fast
from oracles.nala import nala_reference_core as reference_core

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def inputs(B, h, H, W, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, H * W, d, generator=g, dtype=dtype) for _ in range(3))
    if H * W > 2:
        q[0, 0, 1] = 0  # a zero query: d(0) = 0, its output is 0
        q[-1, -1, 2, : d // 2] = 0  # zeros inside a query
    sin, cos = RoPE2d(d)((H, W))
    return q, k, v, (sin.to(dtype), cos.to(dtype))


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('use_rope', [True, False])
@pytest.mark.parametrize('shape', [(2, 2, 7, 9, 16), (1, 3, 12, 5, 32), (1, 1, 1, 1, 8)])
def test_kernel_matches_reference(dtype, use_rope, shape):
    q, k, v, rope = inputs(*shape, dtype)
    rope = rope if use_rope else None
    want = reference_core(q, k, v, rope=rope)
    with torch.no_grad():
        got = nala_attention_fast(q, k, v, 3., 1e-6, *(rope or (None, None)))
    assert got.shape == want.shape and got.dtype == dtype and torch.isfinite(got).all()
    assert rel_err(got, want) < TOL[dtype]
    if shape[2] * shape[3] > 2:
        assert got[0, 0, 1].abs().max() == 0  # the zero query
    # inference writes (B, N, h, d) memory order: merging heads is a free view
    assert got.transpose(1, 2).is_contiguous()


def test_kernel_general_power_and_gradients():
    q, k, v, rope = inputs(1, 2, 5, 6, 8, torch.float64, seed=3)
    with torch.no_grad():
        got = nala_attention_fast(q, k, v, 2.5, 1e-6, *rope)
    assert rel_err(got, reference_core(q, k, v, lam=2.5, rope=rope)) < 1e-10
    q[0, 0, 1] = 0.1  # pow's gradient at 0 is the same in both forms; keep it generic
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    w = torch.randn_like(q)
    (nala_attention_fast(*leaves, 3., 1e-6, *rope) * w).sum().backward()
    (reference_core(*ref, rope=rope) * w).sum().backward()
    for a, b in zip(leaves, ref):
        assert rel_err(a.grad, b.grad) < 1e-10


def nala_pair(dtype, seed=0):
    torch.manual_seed(seed)
    fast = NormAwareLinearAttention(64, 2).to(dtype)
    with torch.no_grad():
        for prm in fast.parameters():
            prm.normal_(0, 0.3)
        fast.ln.weight.add_(1)
    ref = NormAwareLinearAttention(64, 2, core='reference').to(dtype)
    ref.load_state_dict(fast.state_dict())
    return fast, ref


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_module_fast_equals_reference(dtype):
    fast, ref = nala_pair(dtype)
    assert fast.core == 'fast' and ref.core == 'reference'
    x = torch.randn(2, 6 * 7, 64, dtype=dtype)
    with torch.no_grad():
        assert rel_err(fast(x, (6, 7)), ref(x, (6, 7))) < TOL[dtype]
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    fast(xa, (6, 7)).square().sum().backward()
    ref(xb, (6, 7)).square().sum().backward()
    assert rel_err(xa.grad, xb.grad) < TOL[dtype]
    for (name, a), b in zip(fast.named_parameters(), ref.parameters()):
        assert rel_err(a.grad, b.grad) < TOL[dtype] * 10, name


def test_paper_kernel_and_bad_option():
    m = NormAwareLinearAttention(32, 2, kernel='paper')
    assert m.core == 'fast'  # the cos/sin kernel: its reference recomputed in the backward
    with pytest.raises(ValueError, match="kernel='paper' has no Triton core"):
        NormAwareLinearAttention(32, 2, kernel='paper', core='triton')
    with pytest.raises(ValueError, match="core must be one of"):
        NormAwareLinearAttention(32, 2, core='yes')
    with pytest.raises(TypeError, match="'fused' is now core"):
        build_attention(dict(type='NormAwareLinearAttention', fused=True), embed_dims=32,
                        num_heads=2)


def test_backbone_fast_equals_reference():
    arch = dict(embed_dims=[32, 64, 64, 64], depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 4],
                mlp_ratios=[2, 2, 2, 2])
    torch.manual_seed(0)
    net = NaLaFormer(arch=arch, attn_cfg=dict(type='NormAwareLinearAttention')).double().eval()
    mixers = [m for m in net.modules() if isinstance(m, NormAwareLinearAttention)]
    assert len(mixers) == 4
    x = torch.randn(1, 3, 70, 90, dtype=torch.float64)
    with torch.no_grad():
        fast = net(x)
        converted = deploy.convert(net)(x)
        deploy.revert(net)
        for m in mixers:
            m.core = 'reference'
        ref = net(x)
    assert all(rel_err(a, b) < 1e-10 for a, b in zip(fast, ref))
    assert all(rel_err(a, b) < 1e-10 for a, b in zip(converted, ref))


def test_mac_count_is_the_reference_model_whatever_the_kernel():
    """count_macs(module) counts the official form: N (4C^2 + C^2) for qkvg and out_proj, 25 N C
    for the 5x5 LePE and, per head, phi_k^T v and phi_q W (2 * N 2d d) plus the denominator
    (N 2d); the fast kernel's wider GEMMs are not counted, and its setting is restored."""
    from linattn_mm.flops import count_macs
    C, h, H, W = 64, 2, 6, 7
    N, d = H * W, C // h
    m = NormAwareLinearAttention(C, h).eval()
    x = torch.randn(1, N, C)
    want = 5 * N * C * C + 25 * N * C + h * (2 * N * 2 * d * d + N * 2 * d)
    assert count_macs(m, x, (H, W)).total == want
    assert m.core == 'fast'
    deploy.convert(m)
    fast = count_macs(lambda: m(x, (H, W))).total  # the form as it runs: the chunked CPU layer
    # keys: [f cos | f sin]^T v, (4d, d) per head; queries: [f cos | f sin] @ (4d, d) for the
    # numerator and f @ (2d, 1) for the denominator
    assert fast == 5 * N * C * C + 25 * N * C + h * (N * 4 * d * d + N * 4 * d * d + N * 2 * d)
    assert type(m) is deploy.mixers.NormAwareLinearAttentionCPU  # restored after counting
    with torch.no_grad():
        deploy.revert(m)  # the unchunked fast kernel: RoPE folded, (4d, d) matrices on both sides
        assert count_macs(lambda: m(x, (H, W))).total == want + h * 2 * N * 2 * d * d
