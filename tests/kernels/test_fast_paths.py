"""Fast paths against their references: the Pola fast kernel (:mod:`linattn_mm.ops.pola.fast`)
against the reference core, the module with ``core='fast'`` (the default) against
``core='reference'``, its inference form (:func:`linattn_mm.deploy.convert`), and whole Pola-PVT-T /
Pola-Swin-T backbones, outputs and gradients, in float32 (1e-5 relative) and float64 (1e-10
relative)."""
import sys
import types

import numpy as np
import pytest
import torch

from linattn_mm import deploy
from linattn_mm.models.attentions import build_attention
from linattn_mm.models.attentions.pola import PolaLinearAttention
from linattn_mm.models.backbones import LinAttnPVT, LinAttnSwin
from linattn_mm.ops.pola import (polarity_attention_fast, polarity_attention_reference,
                                 polarity_features)

polarity_attention = polarity_attention_reference

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def assert_rel(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()
    err = rel_err(got, want)
    assert err < TOL[dtype], f'relative error {err:.3g} >= {TOL[dtype]:g}'


def randomise_(module, seed=0, pola_only=False):
    """Non-trivial values for every parameter (power / scale / PE start at zero); with
    ``pola_only`` only for the Pola-specific ones (power, scale, positional_encoding, dwc), the
    rest keeping its initialisation (whole networks with every weight at std 0.3 are so
    ill-conditioned that float32 rounding alone moves their outputs by ~1e-5)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit('.', 1)[-1]
            if pola_only and leaf not in ('scale', 'power', 'positional_encoding') \
                    and '.dwc.' not in name:
                continue
            if leaf == 'scale':
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
            elif leaf == 'power':
                p.copy_(torch.randn(p.shape, generator=g))
            elif 'norm' in name and leaf == 'weight':
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def kernel_inputs(B, h, N, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, N, d, generator=g, dtype=dtype)
    k = torch.randn(B, h, n, d, generator=g, dtype=dtype)
    v = torch.randn(B, h, n, d, generator=g, dtype=dtype)
    p = 1 + 4 * torch.rand(1, h, 1, d, generator=g, dtype=dtype)
    inv_s = 0.5 + torch.rand(1, h, 1, d, generator=g, dtype=dtype)
    bias = 0.3 * torch.randn(1, h, n, d, generator=g, dtype=dtype)
    return q, k, v, p, inv_s, bias


def temp(inv_s):
    """The temperature ``s`` whose inverse the kernels multiply by."""
    return None if inv_s is None else 1 / inv_s


def reference_core(q, k, v, p, inv_s=None, bias=None):
    if bias is not None:
        k = k + bias
    if inv_s is not None:
        q, k = q * inv_s, k * inv_s
    return polarity_attention(q, k, v, p)


# ------------------------------------------------------------------------------------------------
# the kernel
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('B,h,N,n,d', [(2, 3, 37, 37, 8), (1, 2, 50, 13, 6), (2, 1, 17, 17, 7),
                                       (1, 2, 1, 5, 4)])
@pytest.mark.parametrize('folded', [False, True])
def test_kernel_matches_reference(dtype, B, h, N, n, d, folded):
    q, k, v, p, inv_s, bias = kernel_inputs(B, h, N, n, d, dtype)
    args = (inv_s, bias) if folded else (None, None)
    want = reference_core(q, k, v, p, *args)
    with torch.no_grad():  # inference path (in-place ops, exp/log power)
        got = polarity_attention_fast(q, k, v, p, temperature=temp(args[0]), k_bias=args[1])
    assert_rel(got, want, dtype)
    # the autograd path gives the same numbers
    qg = q.clone().requires_grad_()
    got_g = polarity_attention_fast(qg, k, v, p, temperature=temp(args[0]), k_bias=args[1])
    assert_rel(got_g.detach(), want, dtype)


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_kernel_zeros_and_signs(dtype):
    """Exact zeros (relu boundary) and all-positive / all-negative channels."""
    q, k, v, p, _, _ = kernel_inputs(1, 2, 24, 24, 6, dtype, seed=3)
    q[..., :5, :] = 0
    k[..., 0] = k[..., 0].abs()
    k[..., 1] = -k[..., 1].abs()
    want = polarity_attention(q, k, v, p)
    with torch.no_grad():
        assert_rel(polarity_attention_fast(q, k, v, p), want, dtype)
    feats = polarity_features(k, p)
    ref = torch.cat([torch.relu(k) ** p, torch.relu(-k) ** p], -1)
    assert_rel(feats, ref, dtype)


def test_kernel_gradients_match_reference():
    q, k, v, p, inv_s, bias = kernel_inputs(2, 3, 19, 19, 6, torch.float64, seed=1)
    q[0, 0, 0, :2] = 0  # gradients at the relu boundary: 0, not NaN
    leaves = [t.clone().requires_grad_() for t in (q, k, v, p, inv_s, bias)]
    leaves2 = [t.clone().requires_grad_() for t in (q, k, v, p, inv_s, bias)]
    w = torch.randn(2, 3, 19, 6, dtype=torch.float64)
    (reference_core(*leaves) * w).sum().backward()
    qq, kk, vv, pp, ss, bb = leaves2
    (polarity_attention_fast(qq, kk, vv, pp, temperature=1 / ss, k_bias=bb) * w).sum().backward()
    for a, b in zip(leaves, leaves2):
        assert torch.isfinite(b.grad).all()
        assert_rel(b.grad, a.grad, torch.float64)


# ------------------------------------------------------------------------------------------------
# the module: core='fast' (the default) and its inference form against core='reference' 
# ------------------------------------------------------------------------------------------------
MODULE_CASES = [
    dict(qkv_layout='qg_kv', hw=(5, 7)),
    dict(qkv_layout='qg_kv', hw=(5, 7), num_extra_tokens=1),
    dict(qkv_layout='qg_kv', hw=(6, 7), la_sr_ratio=2),
    dict(qkv_layout='qg_kv', hw=(7, 9), la_sr_ratio=2, num_extra_tokens=1),
    dict(qkv_layout='qkvg', hw=(5, 7)),
    dict(qkv_layout='qkvg', hw=(4, 6), num_extra_tokens=1),
    dict(qkv_layout='qkvg', hw=(3, 5), gate='static'),
    dict(qkv_layout='qg_kv', hw=(4, 4), gate='none', temperature=False, use_pos_enc=False),
]


def module_pair(case, dims=24, heads=3, dtype=torch.float32, seed=0):
    case = dict(case)
    hw = case.pop('hw')
    torch.manual_seed(seed)
    kw = dict(pretrain_hw=(4, 4)) if case.get('use_pos_enc', True) else {}
    fast = PolaLinearAttention(dims, heads, **kw, **case)
    ref = PolaLinearAttention(dims, heads, core='reference', **kw, **case)
    randomise_(fast, seed)
    ref.load_state_dict(fast.state_dict())
    return fast.to(dtype), ref.to(dtype), hw


def test_default_core_is_fast():
    m = PolaLinearAttention(16, 2, pretrain_hw=(2, 2))
    assert m.core == 'fast'
    assert PolaLinearAttention(16, 2, pretrain_hw=(2, 2), core='reference').core == 'reference'
    with pytest.raises(ValueError,
                       match="core must be one of .*'reference', 'fast', 'fused', 'triton'"):
        PolaLinearAttention(16, 2, pretrain_hw=(2, 2), core='auto')
    with pytest.raises(TypeError, match="'fused' is now core"):
        build_attention(dict(type='PolaLinearAttention', fused=True), embed_dims=16, num_heads=2,
                        pretrain_hw=(2, 2))


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('case', MODULE_CASES)
def test_module_fast_equals_reference(case, dtype):
    fast, ref, hw = module_pair(case, dtype=dtype)
    e = case.get('num_extra_tokens', 0)
    x = torch.randn(2, e + hw[0] * hw[1], 24, dtype=dtype)
    fast.eval(), ref.eval()
    with torch.no_grad():
        want = ref(x, hw)
        assert_rel(fast(x, hw), want, dtype)
        deploy.convert(fast)  # the inference form, where the case has one
        assert_rel(fast(x, hw), want, dtype)
        assert_rel(fast(x, hw), want, dtype)  # second call: cached coefficients / PE


@pytest.mark.parametrize('case', MODULE_CASES[:6])
def test_module_gradients_equal(case):
    fast, ref, hw = module_pair(case, dtype=torch.float64)
    e = case.get('num_extra_tokens', 0)
    x = torch.randn(2, e + hw[0] * hw[1], 24, dtype=torch.float64)
    xf, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = torch.randn_like(x)
    fast.train(), ref.train()
    out_f, out_r = fast(xf, hw), ref(xr, hw)
    assert_rel(out_f.detach(), out_r.detach(), torch.float64)
    (out_f * w).sum().backward()
    (out_r * w).sum().backward()
    assert_rel(xf.grad, xr.grad, torch.float64)
    grads_r = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        assert p.grad is not None, name
        assert_rel(p.grad, grads_r[name].grad, torch.float64)


def test_coefficient_cache_follows_parameter_updates():
    fast, ref, hw = module_pair(MODULE_CASES[4])
    fast.eval(), ref.eval()
    deploy.convert(fast)
    assert type(fast) is deploy.mixers.PolaLinearAttentionCPU
    x = torch.randn(1, hw[0] * hw[1], 24)
    with torch.no_grad():
        fast(x, hw)
        assert 'coefficients' in fast._inference_cache
        for m in (fast, ref):
            m.power.add_(0.5)
            m.scale.mul_(-1)
        assert_rel(fast(x, hw), ref(x, hw), torch.float32)
        for m in (fast, ref):  # writes through .data (as an EMA swap makes them)
            m.power.data.copy_(m.power.data * 0.5 - 0.25)
            m.scale.data.add_(0.75)
        assert_rel(fast(x, hw), ref(x, hw), torch.float32)
    deploy.revert(fast)
    assert '_inference_cache' not in fast.__dict__


@pytest.mark.parametrize('dtype', [torch.bfloat16])
def test_autocast_fast_path_is_finite_and_close(dtype):
    fast, ref, hw = module_pair(MODULE_CASES[4])
    fast.eval(), ref.eval()
    x = torch.randn(1, hw[0] * hw[1], 24) * 3
    with torch.no_grad():
        want = ref(x, hw)
        with torch.autocast('cpu', dtype=dtype):
            got = fast(x, hw)
    assert torch.isfinite(got).all()
    assert rel_err(got.float(), want) < 0.05


# ------------------------------------------------------------------------------------------------
# whole backbones: Pola-PVT-T and Pola-Swin-T with fused=False vs automatic
# ------------------------------------------------------------------------------------------------
SMALL_PVT = dict(embed_dims=[16, 32, 40, 64], depths=[1, 1, 1, 1], num_heads=[1, 2, 5, 8],
                 mlp_ratios=[2, 2, 2, 2], sr_ratios=[8, 4, 2, 1])
SMALL_SWIN = dict(embed_dims=24, depths=[1, 1, 2, 1], num_heads=[3, 3, 6, 12])
POLA_SWIN = [dict(type='PolaLinearAttention', qkv_layout='qkvg'),
             dict(type='PolaLinearAttention', qkv_layout='qkvg'),
             dict(type='WindowSoftmaxAttention', window_size=7),
             dict(type='WindowSoftmaxAttention', window_size=7)]


def build_pair(kind, pvt_sr=1):
    torch.manual_seed(0)
    if kind == 'pvt':
        attn = dict(type='PolaLinearAttention', la_sr_ratio=pvt_sr)
        make = lambda: LinAttnPVT(arch=SMALL_PVT, attn_cfg=attn, pretrain_img_size=64,  # noqa
                                  drop_path_rate=0.)
    else:
        make = lambda: LinAttnSwin(arch=SMALL_SWIN, attn_cfg=POLA_SWIN, pretrain_img_size=64,  # noqa
                                   drop_path_rate=0.)
    fast = randomise_(make(), pola_only=True)
    ref = make()
    ref.load_state_dict(fast.state_dict())
    pola = [m for m in ref.modules() if isinstance(m, PolaLinearAttention)]
    assert pola
    for m in pola:
        m.core = 'reference'
    assert all(m.core == 'fast' for m in fast.modules() if isinstance(m, PolaLinearAttention))
    return fast, ref


@pytest.mark.parametrize('kind,sr', [('pvt', 1), ('pvt', 2), ('swin', 1)])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_backbone_fast_equals_reference(kind, sr, dtype):
    fast, ref = build_pair(kind, sr)
    fast.to(dtype).eval(), ref.to(dtype).eval()
    x = torch.randn(2, 3, 72, 88, dtype=dtype)  # not the pretraining size: PE resized
    with torch.no_grad():
        outs_f, outs_r = fast(x), ref(x)
        outs_c = deploy.convert(fast)(x)  # the inference forms
    assert len(outs_f) == len(outs_r) == len(outs_c) == 4
    for a, c, b in zip(outs_f, outs_c, outs_r):
        assert_rel(a, b, dtype)
        assert_rel(c, b, dtype)


@pytest.mark.parametrize('kind', ['pvt', 'swin'])
def test_backbone_gradients_equal(kind):
    fast, ref = build_pair(kind)
    fast.double().train(), ref.double().train()
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    outs_f, outs_r = fast(x), ref(x)
    # random weights: the outputs are layer-normed, so a plain sum has zero gradient
    ws = [torch.randn_like(o) for o in outs_f]
    loss_f = sum((o * w).sum() for o, w in zip(outs_f, ws))
    loss_r = sum((o * w).sum() for o, w in zip(outs_r, ws))
    loss_f.backward()
    loss_r.backward()
    grads_r = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        if grads_r[name].grad is None:
            assert p.grad is None, name
            continue
        assert_rel(p.grad, grads_r[name].grad, torch.float64)


@pytest.mark.parametrize('layout', ['qg_kv', 'qkvg'])
def test_fast_path_macs_equal_reference(layout):
    """The MAC counter (FlopCounterMode, used by tools/get_flops.py) sees the same GEMM work on
    both paths (no in-place GEMM that it would miss)."""
    from linattn_mm.flops import count_macs
    m = PolaLinearAttention(48, 3, qkv_layout=layout, pretrain_hw=(6, 6)).eval()
    x = torch.randn(2, 36, 48)
    # a plain callable runs the module as it is set (count_macs(module) counts the reference)
    fast = count_macs(lambda: m(x, (6, 6))).total
    deploy.convert(m)  # the chunked inference form
    chunked = count_macs(lambda: m(x, (6, 6))).total
    deploy.revert(m).core = 'reference'
    assert fast == chunked == count_macs(lambda: m(x, (6, 6))).total > 0


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('max_threads', [4, 0])  # numpy's log2, then torch's
def test_log2_in_place(dtype, max_threads, monkeypatch):
    """``ops.common.numpy_log2_`` (numpy's vectorised log2 on CPU with few threads, else torch's) is
    in place and equals the log2 to about an ulp, ``log2(0) = -inf`` without warnings, on a
    strided view too (numpy's path taken here on any CPU)."""
    import warnings

    import linattn_mm.ops.common as common
    monkeypatch.setattr(common, 'NUMPY_LOG2', True)
    monkeypatch.setattr(common, 'NUMPY_LOG2_MAX_THREADS', max_threads)
    base = torch.rand(40, 30, dtype=torch.float64) * 50
    base[3, 4] = 0
    x = base.to(dtype).clone()
    want = torch.log2(x.double())
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        out = common.numpy_log2_(x)
        view = base.to(dtype).clone()[:, ::3]
        common.numpy_log2_(view)
    assert out is x
    assert x[3, 4] == -float('inf')
    ok = torch.isfinite(want)
    tol = 4 * torch.finfo(dtype).eps
    assert ((x.double() - want)[ok].abs() <= tol * want[ok].abs().clamp_min(1)).all()
    assert torch.allclose(view.double(), want[:, ::3], rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize('vectorised', [True, False])
def test_log2_numpy_only_where_vectorised(vectorised, monkeypatch):
    """numpy's log2 is taken only where it is vectorised (``NUMPY_LOG2``: numpy's AVX-512
    target, decided once at import); on other CPUs it is a scalar loop, slower than torch's, and
    torch's op runs. The same values either way."""
    import linattn_mm.ops.common as common
    calls = []

    def spy(a, out):
        calls.append(a.shape)
        return np.log2(a, out=out)
    monkeypatch.setattr(common, 'NUMPY_LOG2', vectorised)
    monkeypatch.setattr(common, 'NUMPY_LOG2_MAX_THREADS', 10 ** 6)  # any number of threads
    monkeypatch.setattr(common, 'np', types.SimpleNamespace(log2=spy, errstate=np.errstate))
    x = torch.rand(7, 5) + 2  # log2 in [1, 1.6): relative errors of an ulp or two
    want = torch.log2(x)
    out = common.numpy_log2_(x)
    assert out is x and torch.allclose(x, want, rtol=4e-7, atol=0)
    assert calls == ([(7, 5)] if vectorised else [])


def test_numpy_log2_vectorised_reads_numpys_loops(monkeypatch):
    """``numpy_log2_vectorised`` (``NUMPY_LOG2`` at import): numpy 2's record of the loop each
    function runs (float32 and float64 log2 not on the baseline loop); without it an AVX-512 CPU
    on Linux x86-64 (numpy's SIMD log2 needs SVML); numpy's CPU module missing: False."""
    import platform as platform_module

    import numpy._core

    import linattn_mm.ops.common as common
    assert common.NUMPY_LOG2 == common.numpy_log2_vectorised()

    def umath(**attrs):
        monkeypatch.setattr(numpy._core, '_multiarray_umath', types.SimpleNamespace(**attrs))
        return common.numpy_log2_vectorised()

    simd = {'current': 'X86_V4', 'available': 'X86_V4 baseline(X86_V2)'}
    scalar = {'current': 'baseline(X86_V2)', 'available': 'X86_V4 baseline(X86_V2)'}
    assert umath(__cpu_targets_info__={'log2': {'ff': simd, 'dd': simd}}) is True
    assert umath(__cpu_targets_info__={'log2': {'ff': simd, 'dd': scalar}}) is False
    assert umath(__cpu_targets_info__={'log2': {'ff': scalar, 'dd': scalar}}) is False
    monkeypatch.setattr(platform_module, 'machine', lambda: 'x86_64')
    for plat, avx512, want in (('linux', True, True), ('linux', False, False),
                               ('darwin', True, False)):
        monkeypatch.setattr(sys, 'platform', plat)
        assert umath(__cpu_features__={'AVX512_SKX': avx512}) is want, (plat, avx512)
    monkeypatch.delattr(numpy._core, '_multiarray_umath')
    monkeypatch.setitem(sys.modules, 'numpy._core._multiarray_umath', None)
    monkeypatch.setitem(sys.modules, 'numpy.core', None)
    assert common.numpy_log2_vectorised() is False


def test_log2_keeps_torch_for_fake_tensors():
    """Under a fake-tensor mode (tracing, export) ``numpy_log2_`` has no memory to hand to numpy
    and runs torch's op, so shapes propagate as usual."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from linattn_mm.ops.common import numpy_log2_
    with FakeTensorMode():
        t = torch.empty(8, 3)
        out = numpy_log2_(t)
    assert out.shape == (8, 3) and out.dtype == torch.float32
