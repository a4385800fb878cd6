"""The Triton cores (and the fused cores' kernels) compiled for a real GPU and checked on
CUDA tensors against the float64 reference cores: every input dtype (float32, bfloat16,
float16), head dims 12 (padded to 16 inside the kernel), 32 and 64, batch 1 and 8, odd grids
(37 x 53 tokens; Pola also with fewer keys than queries, as ``la_sr_ratio`` makes them), strided
query views, and whole converted backbones.

The reference runs on the same rounded inputs in float64, so a float32 output differs from it by
float32 arithmetic alone (the kernels' products use ``input_precision='ieee'``, no TF32); an output
in the input's dtype differs by that dtype's rounding. Fresh random inputs for every case; NaN
never passes. Skipped on machines without CUDA (the interpreter tests in
``test_pola_triton.py`` / ``test_nala_triton.py`` run the same kernels on CPU there)."""
import copy
import zlib

import pytest
import torch

from linattn_mm import deploy
from linattn_mm.models.attentions.nala import NormAwareLinearAttention, RoPE2d
from linattn_mm.models.attentions.pola import PolaLinearAttention
from linattn_mm.models.backbones import LinAttnSwin
from linattn_mm.models.backbones.nalaformer import NaLaFormer
from linattn_mm.ops import dispatch
from linattn_mm.ops.dispatch import triton_module
from linattn_mm.ops.pola.reference import polarity_attention_reference
from kernels.triton_interpret_checks import norm_gate_step, randomise_pola_, train_vs_reference
from oracles.nala import nala_reference_core

pytestmark = [
    pytest.mark.skipif(triton_module() is None, reason='Triton is not installed'),
    pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA'),
]

DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}
#: largest relative error (max |out - ref| / max |ref|) of an output stored in each dtype
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
GRID = (37, 53)  # odd on both sides: 1961 tokens, not a multiple of the 64-token blocks


def rel(got, want):
    got, want = got.double(), want.double()
    assert not torch.isnan(got).any(), 'NaN in the output'
    return ((got - want).abs().max() / want.abs().max()).item()


def seeded(*key):
    return torch.Generator(device='cuda').manual_seed(zlib.crc32(repr(key).encode()))


def strided_queries(B, h, N, d, g):
    """(B, h, N, d) queries as a strided view of a (B, N, 4 h d) buffer, as ``unbind`` of a fused
    projection gives them."""
    q = torch.randn(B, N, 4 * h * d, device='cuda', generator=g)[..., 1::4]
    return q.reshape(B, N, h, d).transpose(1, 2)


@pytest.mark.parametrize('B', [1, 8])
@pytest.mark.parametrize('d', [12, 32, 64])
@pytest.mark.parametrize('dtype', sorted(DTYPES))
@pytest.mark.parametrize('keys', ['all', 'reduced'])
def test_pola_core_on_cuda(B, d, dtype, keys):
    from linattn_mm.ops.pola.triton import polarity_attention_triton
    dt = DTYPES[dtype]
    g = seeded('pola', B, d, dtype, keys)
    h, N = 3, GRID[0] * GRID[1]
    n = N if keys == 'all' else 19 * 27  # la_sr_ratio 2 on the 37 x 53 grid
    q = strided_queries(B, h, N, d, g).to(dt)
    k, v = (torch.randn(B, h, n, d, device='cuda', generator=g).to(dt) for _ in range(2))
    p = 1 + 4 * torch.rand(1, h, 1, d, device='cuda', generator=g)
    s = 0.5 + torch.rand(1, h, 1, d, device='cuda', generator=g)
    pe = (0.3 * torch.randn(1, h, n, d, device='cuda', generator=g)).to(dt)
    qq, kk, vv = q.double() / s.double(), (k.double() + pe.double()) / s.double(), v.double()
    want = polarity_attention_reference(qq, kk, vv, p.double(), 1e-6)
    for out_dtype in (torch.float32, dt):
        got = polarity_attention_triton(q, k, v, p, 1e-6, temperature=s, k_bias=pe,
                                        out_dtype=out_dtype)
        assert got.shape == (B, h, N, d) and got.dtype == out_dtype
        err = rel(got, want)
        assert err < OUT_TOL[out_dtype], f'{dtype} -> {out_dtype}: relative error {err:.3g}'



@pytest.mark.parametrize('B', [1, 8])
@pytest.mark.parametrize('d', [12, 32, 64])
@pytest.mark.parametrize('dtype', sorted(DTYPES))
@pytest.mark.parametrize('keys', ['all', 'reduced'])
@pytest.mark.parametrize('core', ['triton', 'fused'])
def test_pola_core_gradients_on_cuda(B, d, dtype, keys, core, monkeypatch):
    """The Triton backward (and the fused core's: torch's products, Triton's elementwise passes):
    the output and the gradient of every input against plain autograd of the float64 reference
    (q, k, v and the position encoding get theirs in their dtype, p and the temperature in
    float32)."""
    from linattn_mm.ops.pola.fused import polarity_attention_fused
    from linattn_mm.ops.pola.triton import polarity_attention_triton
    monkeypatch.setattr(torch.backends.cuda.matmul, 'allow_tf32', False)  # float32 products
    dt = DTYPES[dtype]
    g = seeded('pola grad', B, d, dtype, keys)
    h, N = 3, GRID[0] * GRID[1]
    n = N if keys == 'all' else 19 * 27
    q = strided_queries(B, h, N, d, g).to(dt)
    k, v = (torch.randn(B, h, n, d, device='cuda', generator=g).to(dt) for _ in range(2))
    p = 1 + 4 * torch.rand(1, h, 1, d, device='cuda', generator=g)
    s = 0.5 + torch.rand(1, h, 1, d, device='cuda', generator=g)
    pe = (0.3 * torch.randn(1, h, n, d, device='cuda', generator=g)).to(dt)
    leaves = [t.requires_grad_() for t in (q, k, v, p, s, pe)]
    grad = torch.randn(B, h, N, d, device='cuda', generator=g)
    if core == 'fused':
        out = polarity_attention_fused(q, k, v, p, 1e-6, temperature=s, k_bias=pe)
    else:
        out = polarity_attention_triton(q, k, v, p, 1e-6, temperature=s, k_bias=pe,
                                        out_dtype=torch.float32)
    assert out.dtype == torch.float32
    if core == 'fused' and dt != torch.float32:  # the result in the inputs' dtype: the
        # float32 result rounded once, as the division writes it
        out_h = polarity_attention_fused(q, k, v, p, 1e-6, temperature=s, k_bias=pe,
                                         out_dtype=dt)
        assert out_h.dtype == dt and torch.equal(out_h, out.detach().to(dt))
    got = torch.autograd.grad(out, leaves, grad)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    qq, kk, vv, pp, ss, bb = ref
    want_out = polarity_attention_reference(qq / ss, (kk + bb) / ss, vv, pp, 1e-6)
    assert rel(out, want_out) < OUT_TOL[torch.float32]
    want = torch.autograd.grad(want_out, ref, grad.double())
    for name, a, b, leaf in zip(('q', 'k', 'v', 'p', 'temperature', 'pe'), got, want, leaves):
        assert a.dtype == leaf.dtype and a.shape == leaf.shape, name
        err = rel(a, b)
        assert err < OUT_TOL[a.dtype], f'{dtype} d{d}: d{name} relative error {err:.3g}'


@pytest.mark.parametrize('core', ['triton', 'fused'])
def test_pola_swin_trains_on_cuda(monkeypatch, core):
    """A training step of a Pola-Swin backbone with every Pola mixer on the Triton core (or the
    fused core): the output, the input's and every parameter's gradient against the float64
    reference cores."""
    monkeypatch.setattr(torch.backends.cudnn, 'allow_tf32', False)
    monkeypatch.setattr(torch.backends.cuda.matmul, 'allow_tf32', False)
    torch.manual_seed(0)
    net = LinAttnSwin(arch=dict(embed_dims=48, depths=[2, 2, 2, 2], num_heads=[2, 3, 6, 12]),
                      attn_cfg=[dict(type='PolaLinearAttention', qkv_layout='qkvg')] * 2 + [
                          dict(type='WindowSoftmaxAttention', window_size=7)] * 2,
                      out_indices=(0, 1, 2, 3), drop_path_rate=0.).cuda().train()
    randomise_pola_(net, 1)
    x = torch.randn(2, 3, 4 * GRID[0], 4 * GRID[1], device='cuda')
    assert train_vs_reference(net, PolaLinearAttention, x, core=core) < 1e-5


@pytest.mark.parametrize('B', [1, 8])
@pytest.mark.parametrize('d', [12, 32, 64])
@pytest.mark.parametrize('dtype', sorted(DTYPES))
@pytest.mark.parametrize('rope', [True, False])
def test_nala_core_on_cuda(B, d, dtype, rope):
    from linattn_mm.ops.nala.triton import nala_attention_triton
    dt = DTYPES[dtype]
    g = seeded('nala', B, d, dtype, rope)
    h, N = 2, GRID[0] * GRID[1]
    q = strided_queries(B, h, N, d, g).to(dt)
    k, v = (torch.randn(B, h, N, d, device='cuda', generator=g) for _ in range(2))
    k, v = (0.7 * k).to(dt), v.to(dt)
    sin, cos = RoPE2d(d).cuda()(GRID) if rope else (None, None)
    want = nala_reference_core(q.double(), k.double(), v.double(), 3., 1e-6,
                               (sin.double(), cos.double()) if rope else None)
    for out_dtype in (torch.float32, dt):
        got = nala_attention_triton(q, k, v, 3., 1e-6, sin, cos, out_dtype=out_dtype)
        assert got.shape == (B, h, N, d) and got.dtype == out_dtype
        err = rel(got, want)
        assert err < OUT_TOL[out_dtype], f'{dtype} -> {out_dtype}: relative error {err:.3g}'



@pytest.mark.parametrize('B', [1, 8])
@pytest.mark.parametrize('d', [12, 32, 64])
@pytest.mark.parametrize('dtype', sorted(DTYPES))
@pytest.mark.parametrize('rope', [True, False])
@pytest.mark.parametrize('core', ['triton', 'fused'])
def test_nala_core_gradients_on_cuda(B, d, dtype, rope, core, monkeypatch):
    """The NaLa Triton backward (and the fused core's): the output and the gradients of q, k, v
    (in their dtype) against plain autograd of the float64 reference core."""
    from linattn_mm.ops.nala.fused import nala_attention_fused
    from linattn_mm.ops.nala.triton import nala_attention_triton
    monkeypatch.setattr(torch.backends.cuda.matmul, 'allow_tf32', False)  # float32 products
    dt = DTYPES[dtype]
    g = seeded('nala grad', B, d, dtype, rope)
    h, N = 2, GRID[0] * GRID[1]
    q = strided_queries(B, h, N, d, g).to(dt)
    k, v = (torch.randn(B, h, N, d, device='cuda', generator=g) for _ in range(2))
    leaves = [t.requires_grad_() for t in (q, (0.7 * k).to(dt), v.to(dt))]
    sin, cos = RoPE2d(d).cuda()(GRID) if rope else (None, None)
    grad = torch.randn(B, h, N, d, device='cuda', generator=g)
    if core == 'fused':
        out = nala_attention_fused(*leaves, 3., 1e-6, sin, cos)
    else:
        out = nala_attention_triton(*leaves, 3., 1e-6, sin, cos, out_dtype=torch.float32)
    got = torch.autograd.grad(out, leaves, grad)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    want_out = nala_reference_core(*ref, 3., 1e-6,
                                   (sin.double(), cos.double()) if rope else None)
    assert out.dtype == torch.float32 and rel(out, want_out) < OUT_TOL[torch.float32]
    want = torch.autograd.grad(want_out, ref, grad.double())
    for name, a, b, leaf in zip('qkv', got, want, leaves):
        assert a.dtype == leaf.dtype and a.shape == leaf.shape, name
        err = rel(a, b)
        assert err < OUT_TOL[a.dtype], f'{dtype} d{d}: d{name} relative error {err:.3g}'


@pytest.mark.parametrize('core', ['triton', 'fused'])
def test_nalaformer_trains_on_cuda(monkeypatch, core):
    """A training step of a NaLaFormer with NaLa in every stage, every mixer on the Triton core
    (or the fused core), against the float64 reference cores: within the float32 error of the
    same step on the default torch core (or 1e-5)."""
    monkeypatch.setattr(torch.backends.cudnn, 'allow_tf32', False)
    monkeypatch.setattr(torch.backends.cuda.matmul, 'allow_tf32', False)
    torch.manual_seed(0)
    net = NaLaFormer(arch=dict(embed_dims=[32, 64, 64, 64], depths=[1, 1, 1, 1],
                               num_heads=[1, 2, 2, 2], mlp_ratios=[2, 2, 2, 2]),
                     attn_cfg=dict(type='NormAwareLinearAttention'), out_indices=(0, 1, 2, 3),
                     drop_path_rate=0., norm_eval=True).cuda().train()
    x = torch.randn(2, 3, 4 * GRID[0], 4 * GRID[1], device='cuda')
    baseline = train_vs_reference(copy.deepcopy(net), NormAwareLinearAttention, x, core='fast')
    err = train_vs_reference(net, NormAwareLinearAttention, x, core=core)
    assert err < max(1e-5, 1.5 * baseline), (err, baseline)


@pytest.mark.parametrize('layout', ['nhwc', 'nchw'])
@pytest.mark.parametrize('dtype', sorted(DTYPES))
@pytest.mark.parametrize('C', [64, 256])
def test_conv_sums_on_cuda(layout, dtype, C):
    """NaLaFormer blocks' conv sums (ops.ffn.fused) on CUDA: ``x + dwconv(x)`` and the flipped
    sum times gelu'(pre) against the float64 formula (the conv as the interpreter tests write it,
    tap by tap), float32 to 1e-5, the conv and the sum in half precision to their rounding."""
    from linattn_mm.ops.ffn.fused import conv_sum
    from kernels.triton_interpret_checks import _gelu_grad64, _shifted_sum
    g = seeded('conv_sum', layout, dtype, C)
    dt = DTYPES[dtype]
    B, (H, W) = 2, GRID
    x = torch.randn(B, H, W, C, device='cuda', generator=g)
    if layout == 'nchw':
        x = torch.randn(B, C, H, W, device='cuda', generator=g).permute(0, 2, 3, 1)
    x = x.to(dt)
    w = torch.randn(C, 1, 3, 3, device='cuda', generator=g)
    b = torch.randn(C, device='cuda', generator=g)
    pre = torch.randn(B, H, W, C, device='cuda', generator=g).to(dt)
    wr, br = w.to(dt), b.to(dt)  # the conv's weights as it reads them
    z = conv_sum(x, w, b)
    assert z.dtype == dt and z.stride() == x.stride()
    err = rel(z, x.double() + _shifted_sum(x.cpu(), wr.cpu()).cuda() + br.double())
    assert err < OUT_TOL[dt], f'sum: {err:.3g}'
    dz = conv_sum(x, w, None, pre=pre, flip=True)
    want = (x.double() + _shifted_sum(x.cpu(), wr.cpu(), flip=True).cuda()) * _gelu_grad64(pre)
    assert rel(dz, want) < 2 * OUT_TOL[dt], 'flipped sum times gelu\''


def test_nalaformer_trains_on_cuda_with_fused_blocks(monkeypatch):
    """Training steps of the released NaLaFormer layout, four random nets and inputs, on the
    fused blocks (their conv sums as Triton kernels) and the fused NaLa core, then with every
    mixer's fused gated output too, then with the softmax mixers' fused RoPE, against the float64
    reference forms: each form's error, summed over the draws, within 1.5x the float32 error of
    the same steps in the default forms (or 1e-5 a draw).

    The sum, not each draw: the network amplifies float32 rounding (harness
    ``NALA_NETWORK_FLOAT32_SHORTFALL``), and on a GPU one draw's error also varies from run to
    run (atomic adds, cuDNN's choice of kernels): on an H200 the same draw's default-form error
    was 1.03e-5 in one run and 1.39e-5 in another, and the fused forms' errors ranged 0.64-1.60x
    the default forms' over four draws, 0.85-1.11x summed. Each fused kernel has its own strict
    test on CUDA above and below."""
    from linattn_mm.models.attentions.nala import set_fused_gates, set_fused_rope
    from linattn_mm.models.backbones.nalaformer import set_fused_blocks
    monkeypatch.setattr(torch.backends.cudnn, 'allow_tf32', False)
    monkeypatch.setattr(torch.backends.cuda.matmul, 'allow_tf32', False)
    sums = torch.zeros(4, dtype=torch.float64)  # the default forms, then the three fused stages
    draws = 4
    for draw in range(draws):
        torch.manual_seed(draw)
        net = NaLaFormer(arch=dict(embed_dims=[32, 64, 64, 64], depths=[1, 1, 1, 1],
                                   num_heads=[1, 2, 2, 2], mlp_ratios=[2, 2, 2, 2]),
                         drop_path_rate=0., norm_eval=True).cuda().train()
        x = torch.randn(2, 3, 4 * GRID[0], 4 * GRID[1], device='cuda')
        sums[0] += train_vs_reference(copy.deepcopy(net), NormAwareLinearAttention, x,
                                      core='fast')
        assert set_fused_blocks(net, True) == 4
        sums[1] += train_vs_reference(copy.deepcopy(net), NormAwareLinearAttention, x,
                                      core='fused')
        assert set_fused_gates(net, True) == 4  # the NaLa and softmax mixers' gated output
        sums[2] += train_vs_reference(copy.deepcopy(net), NormAwareLinearAttention, x,
                                      core='fused')
        assert set_fused_rope(net, True) == 2  # the softmax mixers of stages 3-4
        sums[3] += train_vs_reference(net, NormAwareLinearAttention, x, core='fused')
    assert (sums[1:] < torch.clamp(1.5 * sums[0], min=1e-5 * draws)).all(), sums


@pytest.mark.parametrize('dtype', ['fp32', 'bf16'])
def test_rope_on_cuda(dtype):
    """The softmax stages' RoPE as one kernel each way (ops.nala.rope_fused) on CUDA: q as a head
    view of a projection, float32 within 1e-6 of float64 plain autograd of the reference
    rotation (output and the projection's gradient), bfloat16 within its rounding; a bf16 mixer
    step under autocast within a unit of bf16 of the same step on core='fast'."""
    from linattn_mm.models.attentions.nala import NaLaSoftmaxAttention
    from linattn_mm.ops.nala import apply_rope
    from linattn_mm.ops.nala.rope_fused import RopeRotateFused, rope_table
    dt = DTYPES[dtype]
    g0 = seeded('rope', dtype)
    B, h, d = 2, 4, 64
    H, W = GRID
    N = H * W
    sin, cos = (t.cuda() for t in RoPE2d(d)((H, W)))
    full = torch.randn(B, N, 4 * h * d, device='cuda', generator=g0).to(dt).requires_grad_()
    heads = full[..., :h * d].unflatten(-1, (h, d)).transpose(1, 2)
    grad = torch.randn(B, h, N, d, device='cuda', generator=g0).to(dt)
    y = RopeRotateFused.apply(heads, rope_table(sin, cos), dt)
    (dx, ) = torch.autograd.grad(y, full, grad)
    full64 = full.detach().double().requires_grad_()
    y64 = apply_rope(full64[..., :h * d].unflatten(-1, (h, d)).transpose(1, 2), sin.double(),
                     cos.double())
    (dx64, ) = torch.autograd.grad(y64, full64, grad.double())
    tol = 1e-6 if dt == torch.float32 else 2 ** -8
    assert y.dtype == dt and rel(y, y64) < tol and rel(dx, dx64) < tol
    if dt == torch.bfloat16:
        m = NaLaSoftmaxAttention(256, 4).cuda().train()
        x = torch.randn(2, N, 256, device='cuda', generator=g0)
        runs = []
        for core in ('fast', 'fused'):
            m.core = core
            m.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            with torch.autocast('cuda', dtype=torch.bfloat16):
                out = m(xi, GRID)
            out.float().square().mean().backward()
            runs.append([out.detach(), xi.grad] + [p.grad for p in m.parameters()])
        for a, b in zip(*runs):
            assert rel(a, b) <= 2 ** -7


@pytest.mark.parametrize('C', [64, 512])
def test_norm_gate_on_cuda(monkeypatch, C):
    """NaLa's gated output with its LayerNorm and gate fused (ops.nala.gate_fused) on CUDA, six
    random draws: float32 against float64 plain autograd (output and every gradient) within 1e-5
    in each; under bf16 autocast the output within a unit of bf16 (relative to its largest) of
    the torch form's in each, and every gradient's error against float64, summed over the draws,
    within 1.05x the torch form's.

    The sum, not each draw: in bf16 which form lands nearer float64 in one draw is luck (on an
    H200, over twelve draws, the fused form's gradients had 0.48-1.12x the torch form's error,
    0.79x on average; 1.12x for the LayerNorm weight in one draw); summed over draws the
    comparison is about the forms, not the rounding of one draw."""
    from linattn_mm.ops.lean_layers import NormGatedLinear
    from linattn_mm.ops.nala.gate_fused import NormGatedLinearFused
    monkeypatch.setattr(torch.backends.cuda.matmul, 'allow_tf32', False)
    B, N = 2, GRID[0] * GRID[1]
    sums = torch.zeros(2, 6, dtype=torch.float64)  # fused, torch form: each gradient's errors
    for draw in range(6):
        g0 = seeded('norm_gate', C, draw)
        s = torch.randn(B, N, C, device='cuda', generator=g0) * 3 + 1
        proj = torch.randn(B, N, 4 * C, device='cuda', generator=g0) * 2  # g: C of its channels
        lw, lb = (torch.randn(C, device='cuda', generator=g0) for _ in range(2))
        w = torch.randn(C, C, device='cuda', generator=g0) / C ** 0.5
        b = torch.randn(C, device='cuda', generator=g0)
        grad = torch.randn(B, N, C, device='cuda', generator=g0)

        args = (s, proj, lw, lb, w, b, grad)
        want = norm_gate_step(None, *(t.double() for t in args))
        for got, ref in zip(norm_gate_step(NormGatedLinearFused, *args), want):
            assert rel(got, ref) < 1e-5
        half = (s, proj.bfloat16(), lw, lb, w, b, grad)  # g as the projection gives it, autocast
        fused = norm_gate_step(NormGatedLinearFused, *half, autocast=True)
        plain = norm_gate_step(NormGatedLinear, *half, autocast=True)
        assert rel(fused[0], plain[0]) <= 2 ** -7
        for i, (a, p, ref) in enumerate(zip(fused[1:], plain[1:], want[1:])):
            sums[0, i] += rel(a, ref)
            sums[1, i] += rel(p, ref)
    assert (sums[0] <= 1.05 * sums[1] + 1e-6).all(), sums


def _converted_vs_reference(net, mixer_cls, x, monkeypatch):
    """Relative error of ``net`` converted for CUDA (its mixers on the Triton cores, float32)
    against the same net with the reference cores in float64, both on the GPU, TF32 off. A
    failed Triton call (which would fall back to the torch kernel with a warning) fails the
    test."""
    mixers = [m for m in net.modules() if isinstance(m, mixer_cls)]
    assert mixers
    failures = []
    monkeypatch.setattr(dispatch, 'TRITON_FAILURES', failures)
    # the convolutions and linear layers around the mixers in exact float32 (cuDNN's default
    # TF32 convolutions alone differ from float64 by about 3e-3)
    monkeypatch.setattr(torch.backends.cudnn, 'allow_tf32', False)
    monkeypatch.setattr(torch.backends.cuda.matmul, 'allow_tf32', False)
    net = net.cuda().eval()
    with torch.no_grad():
        for m in mixers:
            m.core = 'reference'
        want = net.double()(x.double())
        for m in mixers:
            m.core = 'fast'
        deploy.convert(net.float(), 'cuda')
        assert all(m.core == 'triton' for m in mixers)
        got = net(x)
    assert not failures, failures
    return max(rel(a, b) for a, b in zip(got, want))


def test_converted_pola_swin_on_cuda(monkeypatch):
    torch.manual_seed(0)
    net = LinAttnSwin(arch=dict(embed_dims=48, depths=[2, 2, 2, 2], num_heads=[2, 3, 6, 12]),
                      attn_cfg=[dict(type='PolaLinearAttention', qkv_layout='qkvg')] * 2 + [
                          dict(type='WindowSoftmaxAttention', window_size=7)] * 2,
                      out_indices=(0, 1, 2, 3))
    randomise_pola_(net, 1)  # non-trivial power, temperature and position encodings
    x = torch.randn(2, 3, 4 * GRID[0], 4 * GRID[1], device='cuda')
    assert _converted_vs_reference(net, PolaLinearAttention, x, monkeypatch) < 1e-5


def test_converted_nalaformer_on_cuda(monkeypatch):
    torch.manual_seed(0)
    net = NaLaFormer(arch=dict(embed_dims=[32, 64, 64, 64], depths=[1, 1, 1, 1],
                               num_heads=[1, 2, 2, 2], mlp_ratios=[2, 2, 2, 2]),
                     attn_cfg=dict(type='NormAwareLinearAttention'), out_indices=(0, 1, 2, 3))
    x = torch.randn(2, 3, 4 * GRID[0], 4 * GRID[1], device='cuda')
    assert _converted_vs_reference(net, NormAwareLinearAttention, x, monkeypatch) < 1e-5
