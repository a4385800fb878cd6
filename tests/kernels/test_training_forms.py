"""The lean training forms against plain autograd of the reference forms: outputs and the
gradients of every input and parameter equal in float64 (1e-10 relative) and float32 (1e-5), for
the attention cores (Pola; NaLa with both kernels), the FFN halves, the small lean layers and whole
backbones (with gradient checkpointing, frozen stages, class tokens, ``la_sr_ratio``, odd sizes);
and what the lean layers keep for backward."""
import contextlib
import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from linattn_mm.models.attentions import build_attention
from linattn_mm.models.attentions.nala import RoPE2d
from linattn_mm.models.backbones import LinAttnPVT, LinAttnSwin, LinAttnViT
from linattn_mm.models.backbones.nalaformer import ConvFFN, NaLaFormer
from linattn_mm.models.utils.layers import Mlp
from linattn_mm.ops import common
from linattn_mm.ops.ffn import FFNBranch, conv_ffn_branch, ffn_branch
from linattn_mm.ops.lean_layers import (CONV_BACKWARD_FORMS, DepthwiseConvTokens, GatedLinear,
                                        NormGatedLinear, conv_backward_form,
                                        depthwise_conv_tokens)
from linattn_mm.ops.nala import nala_attention_fast, nala_attention_reference
from linattn_mm.ops.pola import polarity_attention_fast, polarity_attention_reference

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
DTYPES = [torch.float32, torch.float64]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def grads_of(fn, inputs, weight):
    """``d (fn(*inputs) * weight).sum() / d input`` for every input that requires grad."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t
              for t in inputs]
    out = fn(*leaves)
    (out * weight).sum().backward()
    return out.detach(), [t.grad for t in leaves if torch.is_tensor(t) and t.requires_grad]


def assert_same_gradients(fast, ref, inputs, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    probe = ref(*[t.detach() if torch.is_tensor(t) else t for t in inputs])
    weight = torch.randn(probe.shape, generator=g, dtype=probe.dtype)
    out_f, grads_f = grads_of(fast, inputs, weight)
    out_r, grads_r = grads_of(ref, inputs, weight)
    assert rel(out_f, out_r) < TOL[dtype]
    assert len(grads_f) == len(grads_r) > 0
    for i, (a, b) in enumerate(zip(grads_f, grads_r)):
        assert a is not None and torch.isfinite(a).all(), i
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert rel(a, b) < TOL[dtype], (i, rel(a, b))


def rand(*shape, dtype, g, scale=1., grad=True):
    return (torch.randn(*shape, generator=g, dtype=dtype) * scale).requires_grad_(grad)


# ------------------------------------------------------------------------------------------------
# the attention cores
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('dtype', DTYPES)
# N = n: with rows None one joint pass for q and k (ops.pola.fast.joint_pass), else chunk loops
@pytest.mark.parametrize('B,h,N,n,d', [(2, 3, 37, 37, 8), (1, 2, 40, 13, 7), (2, 1, 17, 17, 6),
                                       (1, 2, 19, 19, 5)])
@pytest.mark.parametrize('frozen', [False, True])  # exponents / temperature / PE without grads
@pytest.mark.parametrize('rows', [None, 5])  # the backward in one chunk, or in chunks of 5 tokens
def test_pola_core(dtype, B, h, N, n, d, frozen, rows):
    g = torch.Generator().manual_seed(N)
    q, k, v = rand(B, h, N, d, dtype=dtype, g=g), rand(B, h, n, d, dtype=dtype, g=g), \
        rand(B, h, n, d, dtype=dtype, g=g)
    with torch.no_grad():
        q[0, 0, 0, :2] = 0  # the ReLU boundary: zero gradients in both forms
    p = (1 + 4 * torch.rand(1, h, 1, d, generator=g, dtype=dtype)).requires_grad_(not frozen)
    s = (0.5 + torch.rand(1, h, 1, d, generator=g, dtype=dtype)).requires_grad_(not frozen)
    b = rand(1, h, n, d, dtype=dtype, g=g, scale=0.3, grad=not frozen)
    assert_same_gradients(partial(polarity_attention_fast, rows=rows),
                          polarity_attention_reference, [q, k, v, p, 1e-6, s, b], dtype)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('rows', [None, 4])  # one joint pass, or chunks of 4 tokens
def test_pola_core_bias_shared_by_the_tokens(dtype, rows):
    """A key bias broadcast over the tokens (1, h, 1, d), no temperature."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (rand(2, 2, 11, 6, dtype=dtype, g=g) for _ in range(3))
    p = (1 + 4 * torch.rand(1, 2, 1, 6, generator=g, dtype=dtype)).requires_grad_()
    b = rand(1, 2, 1, 6, dtype=dtype, g=g, scale=0.3)
    assert_same_gradients(partial(polarity_attention_fast, rows=rows),
                          polarity_attention_reference, [q, k, v, p, 1e-6, None, b], dtype)


def test_pola_core_joint_pass_where_queries_and_keys_are_one_chunk_each(monkeypatch):
    """The forward and the backward take q and k in one pass where both are one chunk of the same
    shape (the default off CPU, and on CPU for maps up to a chunk), else the chunk loops; both
    give the reference's gradients (above)."""
    import linattn_mm.ops.pola.autograd as pola_autograd
    import linattn_mm.ops.pola.fast as pola_fast
    taken = []
    joint = pola_fast.joint_pass
    for mod in (pola_fast, pola_autograd):
        monkeypatch.setattr(mod, 'joint_pass', lambda *a: taken.append(joint(*a)) or taken[-1])
    g = torch.Generator().manual_seed(2)
    for (N, n, rows), want in (((37, 37, None), True), ((37, 37, 5), False),
                               ((37, 13, None), False)):
        taken.clear()
        q = rand(2, 3, N, 8, dtype=torch.float64, g=g)
        k, v = (rand(2, 3, n, 8, dtype=torch.float64, g=g) for _ in range(2))
        p = (1 + 4 * torch.rand(1, 3, 1, 8, generator=g, dtype=torch.float64))
        polarity_attention_fast(q, k, v, p, rows=rows).sum().backward()
        assert taken == [want, want], (N, n, rows)


def _nala_inputs(seed, dtype, rope):
    """q, k, v (2, 2, 30, 8) on a 5 x 6 grid, with a zero query and zeros inside another, and the
    RoPE tables (or Nones)."""
    g = torch.Generator().manual_seed(seed)
    B, h, H, W, d = 2, 2, 5, 6, 8
    q, k, v = (rand(B, h, H * W, d, dtype=dtype, g=g) for _ in range(3))
    with torch.no_grad():
        q[0, 0, 1] = 0  # a zero query
        q[1, 1, 2, :3] = 0  # zeros inside a query
    sin, cos = RoPE2d(d).to(dtype)((H, W)) if rope else (None, None)
    return q, k, v, sin, cos


# (kernel, rows): the official kernel in one chunk (30 tokens) or in chunks of 7 tokens and a
# last of 2 (the CPU training form's loops); the paper's kernel has no chunks
NALA_FORMS = [('official', None), ('official', 7), ('paper', None)]


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('kernel,rows', NALA_FORMS)
@pytest.mark.parametrize('rope,lam', [(True, 3.), (False, 3.), (True, 2.5)])
def test_nala_core(dtype, kernel, rows, rope, lam):
    q, k, v, sin, cos = _nala_inputs(3, dtype, rope)
    assert_same_gradients(partial(nala_attention_fast, rows=rows), nala_attention_reference,
                          [q, k, v, lam, 1e-6, sin, cos, kernel], dtype)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('kernel,rows', NALA_FORMS)
@pytest.mark.parametrize('rope,query_power', [(False, 2.), (True, 1.5), (False, 3.7)])
def test_nala_core_constant_query_power(dtype, kernel, rows, rope, query_power):
    """A constant query power (the paper's Table 5 ablation) in the fast core's backward."""
    q, k, v, sin, cos = _nala_inputs(4, dtype, rope)
    assert_same_gradients(partial(nala_attention_fast, query_power=query_power, rows=rows),
                          partial(nala_attention_reference, query_power=query_power),
                          [q, k, v, 3., 1e-6, sin, cos, kernel], dtype)


def test_nala_core_chunks_on_cpu_only(monkeypatch):
    """The training form's chunks: on CPU ``TRAIN_CHUNK_ELEMENTS // (B h d)`` tokens (at least
    256), one chunk elsewhere (meta: a GPU's path) and where a map fits one; each chunk of the
    forward and of the backward's two passes makes feature maps of its own tokens only."""
    import linattn_mm.ops.nala.fast as nala_fast
    from linattn_mm.ops.nala.fast import chunk_rows
    assert chunk_rows(torch.empty(1, 1, 67200, 64)) == 1024
    assert chunk_rows(torch.empty(1, 2, 16800, 64)) == 512
    assert chunk_rows(torch.empty(2, 4, 4200, 64)) == 256
    assert chunk_rows(torch.empty(1, 1, 67200, 64, device='meta')) == 67200
    assert chunk_rows(torch.empty(1, 1, 30, 8), rows=7) == 7
    with pytest.raises(ValueError, match='nala_attention_fast: rows must be positive, got 0'):
        chunk_rows(torch.empty(1, 1, 30, 8), rows=0)
    widths = []
    features = nala_fast._query_features
    monkeypatch.setattr(nala_fast, '_query_features',
                        lambda q, *a: widths.append(q.shape[-2]) or features(q, *a))
    import linattn_mm.ops.nala.autograd as nala_autograd
    terms = nala_autograd._query_terms
    monkeypatch.setattr(nala_autograd, '_query_terms',
                        lambda q, *a: widths.append(q.shape[-2]) or terms(q, *a))
    keys = []
    for mod in (nala_fast, nala_autograd):
        power = mod._key_power
        monkeypatch.setattr(mod, '_key_power',
                            lambda k, lam, power=power: keys.append(k.shape[-2]) or power(k, lam))
    q, k, v, sin, cos = _nala_inputs(5, torch.float64, True)
    nala_attention_fast(q, k, v, 3., 1e-6, sin, cos, rows=7).sum().backward()
    assert widths == [7, 7, 7, 7, 2] * 2  # the forward's query chunks, then the backward's
    assert keys == [7, 7, 7, 7, 2] * 2  # the key chunks, forward and backward
    widths.clear()
    keys.clear()
    nala_attention_fast(q, k, v, 3., 1e-6, sin, cos).sum().backward()
    assert widths == [30, 30] and keys == [30, 30]


# ------------------------------------------------------------------------------------------------
# the FFN halves and the small lean layers
# ------------------------------------------------------------------------------------------------
def _params_as_inputs(module, g, dtype, scale=0.3):
    with torch.no_grad():
        for prm in module.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g, dtype=prm.dtype) * scale)
    return module.to(dtype)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('approximate', ['none', 'tanh'])
@pytest.mark.parametrize('rows', [None, 7])  # 30 tokens: one chunk, or chunks of 7 and 2
def test_ffn_branch(dtype, approximate, rows):
    g = torch.Generator().manual_seed(0)
    norm = _params_as_inputs(torch.nn.LayerNorm(12), g, dtype, 1.)
    mlp = _params_as_inputs(Mlp(12, 37), g, dtype)
    mlp.act.approximate = approximate
    x = rand(2, 15, 12, dtype=dtype, g=g)
    params = [norm.weight, norm.bias, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]

    def plain(x, *ps):
        n = F.layer_norm(x, (12, ), ps[0], ps[1], norm.eps)
        return F.linear(F.gelu(F.linear(n, ps[2], ps[3]), approximate=approximate), ps[4], ps[5])

    def lean(x, *ps):
        return FFNBranch.apply(x, ps[0], ps[1], norm.eps, *ps[2:], approximate, rows)
    assert_same_gradients(lean, plain, [x] + [p.detach().requires_grad_() for p in params], dtype)
    # through the modules, as the blocks call it
    y = ffn_branch(x.detach(), norm, mlp)
    assert rel(y, plain(x.detach(), *params).detach()) < TOL[dtype]


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('conv_out', ['as on CPU', 'channels-first'])
def test_conv_ffn_branch(dtype, bias, conv_out, monkeypatch):
    if conv_out == 'channels-first':  # the depth-wise conv's output as a GPU kernel and meta
        # return it (CPU keeps the channels-last layout of its input): the sum with the
        # activation is then written into a (B, H, W, R) buffer
        conv2d = F.conv2d
        monkeypatch.setattr(F, 'conv2d', lambda *a, **k: conv2d(*a, **k).contiguous())
    g = torch.Generator().manual_seed(1)
    ffn = _params_as_inputs(ConvFFN(8, 24), g, dtype)
    if not bias:
        ffn.dwconv.bias = None
    norm = _params_as_inputs(torch.nn.LayerNorm(8), g, dtype, 1.)
    x = rand(2, 5, 7, 8, dtype=dtype, g=g)  # (B, H, W, C)
    x_ref = x.detach().clone().requires_grad_()
    w = torch.randn(2, 5, 7, 8, generator=g, dtype=dtype)
    ref = ffn(norm(x_ref).permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    (ref * w).sum().backward()
    want = {n: p.grad.clone() for n, p in list(ffn.named_parameters()) +
            [('ln.' + n, p) for n, p in norm.named_parameters()]}
    for p in list(ffn.parameters()) + list(norm.parameters()):
        p.grad = None
    got = conv_ffn_branch(x, norm, ffn)
    (got * w).sum().backward()
    assert rel(got, ref) < TOL[dtype] and rel(x.grad, x_ref.grad) < TOL[dtype]
    for n, p in list(ffn.named_parameters()) + [('ln.' + n, p) for n, p in
                                                norm.named_parameters()]:
        assert rel(p.grad, want[n]) < TOL[dtype], n


def test_conv_ffn_branch_copies_no_map_when_the_conv_is_channels_first():
    """On ``meta`` (as with a GPU's own depth-wise kernel) the conv comes back channels-first: the
    branch's step still copies none of its hidden-width maps (``fc2`` reads the sum as it is,
    forward and backward)."""
    from linattn_mm.utils import OperationCounter, meta_autocast
    ffn, norm = ConvFFN(16, 64).to('meta'), torch.nn.LayerNorm(16).to('meta')
    x = torch.empty(2, 24, 32, 16, device='meta', requires_grad=True)
    for ac in (None, torch.bfloat16):
        with OperationCounter() as ops:
            with meta_autocast(ac) if ac else contextlib.nullcontext():
                y = conv_ffn_branch(x, norm, ffn)
            y.float().sum().backward()
        assert 'clone' not in ops.by_name, (ac, ops.by_name)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('bias', [True, False])
def test_small_lean_layers(dtype, bias):
    g = torch.Generator().manual_seed(2)
    B, H, W, C = 2, 5, 6, 8
    v = rand(B, H * W, C, dtype=dtype, g=g)
    wt = rand(C, 1, 5, 5, dtype=dtype, g=g, scale=0.2)
    bt = rand(C, dtype=dtype, g=g) if bias else None

    def conv_plain(v, wt, bt):
        m = v.reshape(B, H, W, C).permute(0, 3, 1, 2)
        return F.conv2d(m, wt, bt, padding=(2, 2), groups=C).flatten(2).transpose(1, 2)
    for form in CONV_BACKWARD_FORMS:
        assert_same_gradients(
            lambda v, wt, bt: DepthwiseConvTokens.apply(v, (H, W), wt, bt, (2, 2), None, form),
            conv_plain, [v, wt, bt] if bias else [v, wt, None], dtype)
    s, gate = rand(B, 7, C, dtype=dtype, g=g), rand(B, 7, C, dtype=dtype, g=g)
    lw = rand(5, C, dtype=dtype, g=g)
    lb = rand(5, dtype=dtype, g=g) if bias else None
    for rows in (None, 3):  # 14 tokens: one chunk, or chunks of 3 and a last of 2
        assert_same_gradients(lambda s, gt, w, b: GatedLinear.apply(s, gt, w, b, rows),
                              lambda s, gt, w, b: F.linear(s * gt, w, b), [s, gate, lw, lb], dtype)
    nw, nb = 1 + rand(C, dtype=dtype, g=g, scale=0.1), rand(C, dtype=dtype, g=g, scale=0.1)
    assert_same_gradients(
        lambda s, nw, nb, gt, w, b: NormGatedLinear.apply(s, nw, nb, 1e-5, gt, w, b),
        lambda s, nw, nb, gt, w, b: F.linear(F.layer_norm(s, (C, ), nw, nb, 1e-5) * F.silu(gt),
                                             w, b), [s, nw, nb, gate, lw, lb], dtype)


# ------------------------------------------------------------------------------------------------
# whole backbones: the default (lean) training forms against every core set to 'reference'
# ------------------------------------------------------------------------------------------------
POLA_L = dict(type='PolaLinearAttention', qkv_layout='qkvg')
WIN = dict(type='WindowSoftmaxAttention', window_size=4)
NALA = dict(type='NormAwareLinearAttention')
SOFT = dict(type='NaLaSoftmaxAttention')
SMALL_PVT = dict(embed_dims=[16, 32, 40, 64], depths=[1, 1, 1, 1], num_heads=[1, 2, 5, 8],
                 mlp_ratios=[2, 2, 2, 2], sr_ratios=[8, 4, 2, 1])
BACKBONES = {
    'pola-swin': lambda **kw: LinAttnSwin(arch=dict(embed_dims=24, depths=[1, 1, 2, 1],
                                                    num_heads=[3, 3, 6, 12]),
                                          attn_cfg=[POLA_L, POLA_L, WIN, WIN],
                                          pretrain_img_size=64, drop_path_rate=0., **kw),
    'pola-pvt la_sr 2': lambda **kw: LinAttnPVT(
        arch=SMALL_PVT, attn_cfg=dict(type='PolaLinearAttention', la_sr_ratio=2),
        pretrain_img_size=64, drop_path_rate=0., **kw),
    'pola-deit class token': lambda **kw: LinAttnViT(
        arch=dict(embed_dims=48, depth=4, num_heads=3), attn_cfg=dict(POLA_L, use_pos_enc=False),
        pretrain_img_size=64, drop_path_rate=0., **kw),
    'pola-deit polarity only': lambda **kw: LinAttnViT(  # no G, no DWC (paper Table 3 row 2)
        arch=dict(embed_dims=48, depth=4, num_heads=3),
        attn_cfg=dict(POLA_L, use_pos_enc=False, gate='none', use_dwc=False),
        pretrain_img_size=64, drop_path_rate=0., **kw),
    'pola-swin no dwc': lambda **kw: LinAttnSwin(arch=dict(embed_dims=24, depths=[1, 1, 2, 1],
                                                           num_heads=[3, 3, 6, 12]),
                                                 attn_cfg=[dict(POLA_L, use_dwc=False)] * 2
                                                 + [WIN, WIN],
                                                 pretrain_img_size=64, drop_path_rate=0., **kw),
    'nalaformer released': lambda **kw: NaLaFormer(
        arch=dict(embed_dims=[16, 32, 32, 64], depths=[1, 2, 1, 1], num_heads=[1, 2, 2, 4],
                  mlp_ratios=[2, 2, 2, 2], layer_scale_init_values=[0.5] * 4),
        drop_path_rate=0., **kw),
    'padre-pvt degree 3': lambda **kw: LinAttnPVT(
        arch=SMALL_PVT, attn_cfg=dict(type='PADReMixer', degree=3, kernel_size=5),
        pretrain_img_size=64, drop_path_rate=0., **kw),
    'poly-swin windows': lambda **kw: LinAttnSwin(
        arch=dict(embed_dims=24, depths=[1, 1, 2, 1], num_heads=[3, 3, 6, 12]),
        attn_cfg=dict(type='PolySelfAttention', window_size=4), pretrain_img_size=64,
        drop_path_rate=0., **kw),
    'poly-deit class token': lambda **kw: LinAttnViT(
        arch=dict(embed_dims=48, depth=4, num_heads=3), attn_cfg=dict(type='PolySelfAttention'),
        pretrain_img_size=64, drop_path_rate=0., **kw),
    'setformer-pvt': lambda **kw: LinAttnPVT(
        arch=SMALL_PVT, attn_cfg=dict(type='SeTAttention', num_refs=16, num_iters=5, eps=0.3),
        pretrain_img_size=64, drop_path_rate=0., **kw),
    'nalaformer paper kernel': lambda **kw: NaLaFormer(
        arch=dict(embed_dims=[16, 32, 32, 64], depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 4],
                  mlp_ratios=[2, 2, 2, 2]),
        attn_cfg=[dict(NALA, kernel='paper')] * 2 + [SOFT] * 2, drop_path_rate=0., **kw),
    # the paper's own form: no RoPE, no LePE, no CPE convs; all-linear; its kernel, or the official
    # kernel with a constant query power (Table 5)
    'nalaformer paper form': lambda **kw: NaLaFormer(
        arch=dict(embed_dims=[16, 32, 32, 64], depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 4],
                  mlp_ratios=[2, 2, 2, 2]),
        attn_cfg=dict(NALA, kernel='paper', use_rope=False, use_lepe=False), use_cpe=False,
        drop_path_rate=0., **kw),
    'nalaformer constant power': lambda **kw: NaLaFormer(
        arch=dict(embed_dims=[16, 32, 32, 64], depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 4],
                  mlp_ratios=[2, 2, 2, 2]),
        attn_cfg=dict(NALA, query_power=2., use_rope=False, use_lepe=False), use_cpe=False,
        drop_path_rate=0., **kw),
}


def reference_copy(net):
    """A copy of ``net`` with every mixer and FFN core set to ``'reference'``."""
    ref = copy.deepcopy(net)
    for m in ref.modules():
        for attr in ('core', 'ffn_core'):
            if isinstance(getattr(m, attr, None), str):
                setattr(m, attr, 'reference')
    return ref


def randomise_(net, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            leaf = name.rsplit('.', 1)[-1]
            if leaf in ('power', 'scale', 'positional_encoding') or 'gamma' in leaf:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return net


@pytest.mark.parametrize('name', sorted(BACKBONES))
@pytest.mark.parametrize('with_cp', [False, True])
def test_backbone_gradients_equal_the_reference_forms(name, with_cp):
    kw = dict(with_cp=with_cp, frozen_stages=1) if with_cp else {}
    torch.manual_seed(0)
    net = randomise_(BACKBONES[name](**kw)).double().train()
    ref = reference_copy(net)
    assert any(getattr(m, 'core', None) == 'fast' for m in net.modules())
    x = torch.randn(2, 3, 57, 71, dtype=torch.float64)  # odd sizes: padding in every skeleton
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    outs_f, outs_r = net(xa), ref(xb)
    ws = [torch.randn_like(o) for o in outs_f]
    sum((o * w).sum() for o, w in zip(outs_f, ws)).backward()
    sum((o * w).sum() for o, w in zip(outs_r, ws)).backward()
    for a, b in zip(outs_f, outs_r):
        assert rel(a.detach(), b.detach()) < 1e-10
    assert rel(xa.grad, xb.grad) < 1e-10
    grads_r = dict(ref.named_parameters())
    # relative to the largest gradient of the tensor or, for gradients that are zero in exact
    # arithmetic (a conv bias before a training-mode BatchNorm), of the whole network
    scale = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    for n, p in net.named_parameters():
        want = grads_r[n].grad
        if want is None:
            assert p.grad is None, n
            continue
        err = (p.grad - want).abs().max().item()
        assert err < 1e-10 * max(want.abs().max().item(), 1e-4 * scale), (n, err)
    if with_cp:  # the first stage is frozen: its parameters get no gradient
        frozen = [p for m in net.stage_modules(0) for p in
                  ([m] if isinstance(m, torch.nn.Parameter) else m.parameters())]
        assert frozen and all(not p.requires_grad and p.grad is None for p in frozen)


# ------------------------------------------------------------------------------------------------
# what the lean layers keep for backward
# ------------------------------------------------------------------------------------------------
def saved_bytes(fn, params=()):
    """Bytes of the distinct storages autograd keeps for backward while ``fn()`` runs, the
    storages of ``params`` (the weights) left out."""
    seen, skip = {}, {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize('cfg', [dict(type='PolaLinearAttention', qkv_layout='qkvg'), NALA])
def test_lean_mixer_keeps_the_projection_and_a_few_token_maps(cfg):
    """The lean mixer keeps its input, the projection output (4C a token), one token map for the
    gated output, the RoPE tables (NaLa) and per-head matrices, not the feature maps: less than
    7 token maps of C floats, where the reference keeps over 15."""
    C, h, H, W = 32, 4, 32, 32
    m = build_attention(cfg, embed_dims=C, num_heads=h, pretrain_hw=(H, W))
    x = torch.randn(1, H * W, C, requires_grad=True)
    token_map = H * W * C * 4
    lean = saved_bytes(lambda: m(x, (H, W)), m.parameters()) / token_map
    m_ref = reference_copy(m)
    full = saved_bytes(lambda: m_ref(x, (H, W)), m_ref.parameters()) / token_map
    assert lean < 7 < 15 < full, (lean, full)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('layout', ['head view', 'head view, pairs unaligned',
                                    'contiguous, odd offset'])
def test_rope_as_complex_products_equals_the_reference(dtype, layout):
    """The softmax stages' RoPE as complex products of the channel pairs (the pairs share their
    angle): equal to the reference rotation bit for bit on CPU, gradient included, on a head view
    of a projection and on tensors whose pairs are not aligned in memory (copied first)."""
    from linattn_mm.ops.nala import apply_rope, rotate_pairs
    g = torch.Generator().manual_seed(3)
    if layout == 'contiguous, odd offset':
        x = torch.randn(1 + 2 * 2 * 300 * 32, generator=g, dtype=dtype)[1:].view(2, 2, 300, 32)
    else:
        offset = int(layout.endswith('unaligned'))
        proj = torch.randn(2, 15 * 20, 3 * 64 + offset, generator=g, dtype=dtype)
        x = proj[..., offset + 64:offset + 128].unflatten(-1, (2, 32)).transpose(1, 2)
    sin, cos = (t.to(dtype) for t in RoPE2d(32)((15, 20)))
    w = torch.randn(2, 2, 300, 32, generator=g, dtype=dtype)
    want, (want_g, ) = grads_of(lambda t: apply_rope(t, sin, cos), [x.requires_grad_()], w)
    got, (got_g, ) = grads_of(lambda t: rotate_pairs(t, sin, cos), [x], w)
    assert torch.equal(got, want) and torch.equal(got_g, want_g)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('parts,used', [(4, (0, 1, 2, 3)), (2, (0, 1)), (4, (0, 2, 3)), (3, (1, ))])
def test_split_linear(dtype, bias, parts, used):
    """The projection split into parts, some parts unused (no gradient reaches them): the same
    outputs and gradients as the linear layer and ``unbind``."""
    from linattn_mm.ops.lean_layers import SplitLinear
    g = torch.Generator().manual_seed(parts)
    x = rand(2, 9, 6, dtype=dtype, g=g)
    w = rand(5 * parts, 6, dtype=dtype, g=g)
    b = rand(5 * parts, dtype=dtype, g=g) if bias else None
    weights = [torch.randn(2, 9, 5, generator=g, dtype=dtype) for _ in range(parts)]

    def loss(outs):
        return sum((outs[i] * weights[i]).sum() for i in used)

    def run(split):
        leaves = [t.detach().clone().requires_grad_() if t is not None else None
                  for t in (x, w, b)]
        outs = split(*leaves)
        loss(outs).backward()
        return [o.detach() for o in outs], [t.grad for t in leaves if t is not None]

    want, want_g = run(lambda x, w, b: F.linear(x, w, b).unflatten(-1, (parts, 5)).unbind(-2))
    for rows in (None, 4):  # 18 tokens: one chunk, or chunks of 4 and a last of 2
        got, got_g = run(lambda x, w, b: SplitLinear.apply(x, w, b, parts, rows))
        assert len(got) == parts and all(rel(a, c) < TOL[dtype] for a, c in zip(got, want))
        for a, c in zip(got_g, want_g):
            assert a.dtype == c.dtype and rel(a, c) < TOL[dtype]


def test_split_linear_keeps_the_autocast_cast_of_its_input():
    """Under CPU bf16 autocast the split projection keeps for backward the bfloat16 cast of its
    float32 input (the one autocast makes for the product), not the input: its outputs and
    gradients are those of plain autograd under autocast, bit for bit, with and without
    gradients for every part. A float64 input, which autocast leaves as it is, is kept as it
    is."""
    from linattn_mm.ops.lean_layers import SplitLinear
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 40, 16, generator=g)
    w, b = torch.randn(4 * 8, 16, generator=g), torch.randn(4 * 8, generator=g)
    weights = [torch.randn(2, 40, 8, generator=g) for _ in range(4)]

    def run(split, used, dtype=torch.float32):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w, b)]
        kept = []

        def pack(t):
            kept.append((t.dtype, tuple(t.shape)))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast('cpu', dtype=torch.bfloat16):
                outs = split(*leaves)
        sum((outs[i].float() * weights[i]).sum() for i in used).backward()
        return outs, [t.grad for t in leaves], kept

    for used, rows in (((0, 1, 2, 3), None), ((1, 3), None), ((0, 1, 2, 3), 16)):
        # (rows: chunks of 16 tokens, the chunked path, in the autocast dtype too)
        got, got_g, kept = run(lambda x, w, b: SplitLinear.apply(x, w, b, 4, rows), used)
        assert kept == [(torch.bfloat16, (80, 16)), (torch.float32, (32, 16))]
        want, want_g, _ = run(
            lambda x, w, b: F.linear(x, w, b).unflatten(-1, (4, 8)).unbind(-2), used)
        assert all(a.dtype == torch.bfloat16 and torch.equal(a, c) for a, c in zip(got, want))
        for a, c in zip(got_g, want_g):
            assert a.dtype == c.dtype == torch.float32 and torch.equal(a, c)
    _, got_g, kept = run(lambda x, w, b: SplitLinear.apply(x, w, b, 4), (0, 1), torch.float64)
    assert kept == [(torch.float64, (2, 40, 16)), (torch.float64, (32, 16))]
    assert all(t.dtype == torch.float64 for t in got_g)


def test_depthwise_conv_under_autocast_returns_the_autocast_dtype_in_bands_and_in_one():
    """Under CPU bf16 autocast with a float32 kernel the conv runs in bfloat16, and both forward
    forms return it in bfloat16, as the plain conv."""
    v = torch.randn(1, 10 * 9, 8)
    w, b = torch.randn(8, 1, 5, 5), torch.randn(8)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        want = depthwise_conv_tokens(v, (10, 9), w, b, (2, 2), lean=False)
        outs = [DepthwiseConvTokens.apply(v, (10, 9), w, b, (2, 2), rows, None, None)
                for rows in (None, 3)]  # one band, bands of 3 rows
    assert want.dtype == torch.bfloat16
    for out in outs:
        assert out.dtype == torch.bfloat16 and torch.equal(out, want)


@pytest.mark.parametrize('B,C,H,W,k', [(1, 24, 50, 37, 5), (2, 8, 5, 6, 5), (1, 4, 3, 9, 7),
                                       (3, 16, 20, 11, 5), (1, 6, 1, 12, 5)])
@pytest.mark.parametrize('rows', [None, 1, 3, 16])
def test_depthwise_conv_in_bands(B, C, H, W, k, rows):
    """The depth-wise conv of tokens in bands of rows (halos, a last short band, one-row maps):
    the output, and with both backward forms (the band form: the gradient's bands against the
    flipped kernel, each band of the input convolved with the gradient band as its kernel; the
    CUDA form: ``aten.convolution_backward``) the input and weight gradients, against the float64
    conv and its backward. In float32 the CUDA form is torch's own kernel on the channels-last
    view: its gradients are that kernel's, bit for bit (how close that kernel comes to float64
    depends on the CPU's code path: 1.3e-6 for the weight gradient of a 50 x 37 map with AVX2,
    under 1e-6 with AVX-512); the band form, which sums in float64, is within 1e-6 of float64."""
    g = torch.Generator().manual_seed(B * H)
    x = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    grad = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    w = torch.randn(C, 1, k, k, generator=g, dtype=torch.float64)
    bias = torch.randn(C, generator=g, dtype=torch.float64)
    want_out = F.conv2d(x, w, bias, padding=k // 2, groups=C)
    want_dx, want_dw, _ = torch.ops.aten.convolution_backward(
        grad, x, w, None, [1, 1], [k // 2] * 2, [1, 1], False, [0, 0], C, [True, True, False])

    def tokens(m):
        return m.flatten(2).transpose(1, 2)

    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        v = tokens(x).to(dtype).contiguous().requires_grad_()
        wt = w.to(dtype).requires_grad_()
        for form in CONV_BACKWARD_FORMS:
            v.grad = wt.grad = None
            out = DepthwiseConvTokens.apply(v, (H, W), wt, bias.to(dtype), (k // 2, k // 2), rows,
                                            form)
            out.backward(tokens(grad).to(dtype))
            assert rel(out.double(), tokens(want_out)) < tol
            if form == 'aten' and dtype == torch.float32:
                g32 = tokens(grad).float().contiguous().view(B, H, W, C).permute(0, 3, 1, 2)
                x32 = v.detach().view(B, H, W, C).permute(0, 3, 1, 2)
                torch_dx, torch_dw, _ = torch.ops.aten.convolution_backward(
                    g32, x32, wt.detach(), None, [1, 1], [k // 2] * 2, [1, 1], False, [0, 0], C,
                    [True, True, False])
                assert torch.equal(v.grad, tokens(torch_dx)), form
                assert torch.equal(wt.grad, torch_dw), form
                continue
            assert rel(v.grad.double(), tokens(want_dx)) < tol, form
            assert wt.grad.shape == want_dw.shape and rel(wt.grad.double(), want_dw) < tol, form


def test_conv_backward_form_is_chosen_by_device():
    """The band form on CPU, ``aten.convolution_backward`` elsewhere (CUDA: the band form's weight
    gradient is a grouped conv with an image-sized kernel), an explicit form as given, and a
    clear error for an unknown one."""
    assert conv_backward_form('cpu') == 'bands'
    assert conv_backward_form(torch.device('cuda', 0)) == 'aten'
    assert conv_backward_form('cpu', 'aten') == 'aten'
    with pytest.raises(ValueError, match=r"backward form must be one of \('bands', 'aten'\), "
                       r"got 'fast'"):
        conv_backward_form('cpu', 'fast')


# ------------------------------------------------------------------------------------------------
# sums over the tokens in parts (the GPU form of token_gram), forced on CPU
# ------------------------------------------------------------------------------------------------
def test_token_gram_parts_by_device_and_dtype(monkeypatch):
    """One part on CPU and for half precision; off CPU about ``tokens // 2048``, a divisor of the
    tokens where one lies between half that and that (67200 tokens: 32 parts of 2100; 54400: 25
    of 2176), tokens left over where none does (8191: 3 parts), one part below 4096 tokens."""
    cpu, meta = torch.empty(4, 8), torch.empty(4, 8, device='meta')
    assert common.token_gram_parts(cpu, 67200) == 1
    for tokens, parts in ((67200, 32), (16800, 8), (4200, 2), (54400, 25), (53760, 24),
                          (67201, 17), (8191, 3), (4095, 1), (100, 1)):
        assert common.token_gram_parts(meta, tokens) == parts, tokens
    assert common.token_gram_parts(meta.double(), 16800) == 8
    assert common.token_gram_parts(meta.bfloat16(), 67200) == 1
    assert common.token_gram_parts(meta.half(), 67200) == 1
    monkeypatch.setattr(common, 'TOKENS_PER_GRAM_PART', None)
    assert common.token_gram_parts(meta, 67200) == 1


def test_token_gram_off_cpu_shapes():
    """The parts path as it runs off CPU (meta tensors: shapes only): tokens left over, an
    accumulator, head-split views."""
    a, b = torch.empty(67203, 6, device='meta'), torch.empty(67203, 5, device='meta')
    assert common.token_gram(a, b).shape == (6, 5)
    acc = torch.empty(6, 5, device='meta')
    assert common.token_gram(a, b, acc=acc) is acc
    q = torch.empty(2, 16800, 3, 32, device='meta').transpose(1, 2)
    r = torch.empty(2, 3, 16800, 34, device='meta')
    assert common.token_gram(q, r).shape == (2, 3, 32, 34)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('parts', [1, 3, 7, 50])
def test_token_gram_in_parts(monkeypatch, dtype, parts):
    """``a^T b`` over the tokens in parts (tokens left over, more parts than tokens) equals the
    float64 product: 2-D operands, head-split views of (B, N, h, d) maps, into an accumulator."""
    monkeypatch.setattr(common, 'token_gram_parts', lambda t, tokens: parts)
    tol = {torch.float32: 1e-6, torch.float64: 1e-13}[dtype]
    g = torch.Generator().manual_seed(parts)
    a = torch.randn(40, 6, generator=g, dtype=torch.float64)
    b = torch.randn(40, 5, generator=g, dtype=torch.float64)
    assert rel(common.token_gram(a.to(dtype), b.to(dtype)).double(), a.t() @ b) < tol
    acc = torch.randn(6, 5, generator=g, dtype=torch.float64)
    want = acc + a.t() @ b
    acc = acc.to(dtype)
    assert common.token_gram(a.to(dtype), b.to(dtype), acc=acc) is acc
    assert rel(acc.double(), want) < tol
    q = torch.randn(2, 23, 3, 4, generator=g, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(2, 23, 3, 6, generator=g, dtype=torch.float64).transpose(1, 2)
    for n in (23, 2):
        want = torch.einsum('bhnd,bhne->bhde', q[:, :, :n], v[:, :, :n])
        got = common.token_gram(q[:, :, :n].to(dtype), v[:, :, :n].to(dtype))
        assert rel(got.double(), want) < tol


def force_gram_parts(monkeypatch, parts):
    """Every :func:`~linattn_mm.ops.common.token_gram` in ``parts`` parts, also on CPU; returns
    the list of the token counts of the sums really split (``min(parts, tokens) > 1``)."""
    split = []

    def forced(t, tokens):
        if tokens > 1:
            split.append(tokens)
        return parts
    monkeypatch.setattr(common, 'token_gram_parts', forced)
    return split


@pytest.mark.parametrize('dtype', DTYPES)
def test_training_forms_with_token_sums_in_parts(monkeypatch, dtype):
    """The lean forms' products over the tokens (the Pola and NaLa cores' small matrices and their
    gradients, the weight gradients of the split, gated and norm-gated projections) taken in
    parts, as off CPU: outputs and gradients still equal plain autograd of the reference forms,
    and the parts were really taken."""
    split = force_gram_parts(monkeypatch, 3)
    test_pola_core(dtype, 2, 3, 37, 37, 8, False, None)
    test_pola_core(dtype, 1, 2, 40, 13, 7, False, None)
    pola = len(split)
    test_nala_core(dtype, 'official', None, True, 3.)
    test_nala_core(dtype, 'official', None, False, 3.)
    nala = len(split) - pola
    test_small_lean_layers(dtype, True)
    test_split_linear(dtype, True, 4, (0, 2, 3))
    test_split_linear(dtype, True, 4, (0, 1, 2, 3))  # the joined gradient map in one chunk
    # Pola, per call: the forward's product of [k+ | k-] with v, the backward's of [q+ | q-]
    assert pola >= 4 and nala >= 4 and len(split) - pola - nala >= 8


@pytest.mark.parametrize('name', ['pola-swin', 'pola-pvt la_sr 2', 'nalaformer released'])
def test_backbone_gradients_with_token_sums_in_parts(monkeypatch, name):
    """Whole backbones (float64, odd sizes) with every sum over the tokens of the lean forms in 5
    parts: the outputs and all gradients equal the reference forms as without parts."""
    split = force_gram_parts(monkeypatch, 5)
    test_backbone_gradients_equal_the_reference_forms(name, False)
    assert len(split) >= 8


# ------------------------------------------------------------------------------------------------
# half-precision inputs (the projections under autocast): kept as they are, computed in float32
# ------------------------------------------------------------------------------------------------
def _half_inputs_against_float32(fast, ref, halves, others, out_tol=1e-5):
    """``fast`` on bfloat16 ``halves`` and float32 ``others`` against ``ref`` on float32 copies of
    the same values: the outputs to ``out_tol`` (both in float32); the gradients of the halves in
    bfloat16 against the reference's float32 gradients rounded to bfloat16: equal but for rare
    ties (each side rounds a float32 gradient equal to float32 rounding, 1e-5 of the largest),
    off by at most one bfloat16 unit (plus that float32 difference) where not; those of the
    others in float32 to 1e-5."""
    g = torch.Generator().manual_seed(7)
    hs = [t.detach().bfloat16().requires_grad_() for t in halves]
    hr = [t.detach().float().requires_grad_() for t in hs]
    os_f = [t.detach().clone().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t
            for t in others]
    os_r = [t.detach().clone().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t
            for t in others]
    out_f, out_r = fast(*hs, *os_f), ref(*hr, *os_r)
    assert out_f.dtype == out_r.dtype == torch.float32
    assert rel(out_f.detach(), out_r.detach()) < out_tol
    w = torch.randn(out_r.shape, generator=g)
    (out_f * w).sum().backward()
    (out_r * w).sum().backward()
    for a, b in zip(hs, hr):
        assert a.grad.dtype == torch.bfloat16
        want = b.grad.bfloat16().float()
        diff = (a.grad.float() - want).abs()
        ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
        assert (diff <= ulp + 1e-5 * want.abs().max()).all()
        assert (diff > 0).float().mean() < 0.01
    for a, b in zip(os_f, os_r):
        if torch.is_tensor(a) and a.requires_grad:
            assert a.grad.dtype == torch.float32 and rel(a.grad, b.grad) < 1e-5


def test_cores_take_half_precision_inputs_as_they_are():
    """The Pola and NaLa training Functions with bfloat16 q, k, v (and a bfloat16 key bias) equal
    the reference cores on float32 copies; they keep the bfloat16 tensors for backward, not
    float32 copies (the saved storages are the inputs' own)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (rand(2, 3, 37, 8, dtype=torch.float32, g=g) for _ in range(3))
    b = rand(1, 3, 37, 8, dtype=torch.float32, g=g, scale=0.3)
    p = (1 + 4 * torch.rand(1, 3, 1, 8, generator=g)).requires_grad_()
    s = (0.5 + torch.rand(1, 3, 1, 8, generator=g)).requires_grad_()
    _half_inputs_against_float32(
        lambda q, k, v, b, p, s: polarity_attention_fast(q, k, v, p, 1e-6, s, b),
        lambda q, k, v, b, p, s: polarity_attention_reference(q, k, v, p, 1e-6, s, b),
        [q, k, v, b], [p, s])
    qn, kn, vn, sin, cos = _nala_inputs(5, torch.float32, True)
    _half_inputs_against_float32(
        lambda q, k, v: nala_attention_fast(q, k, v, 3., 1e-6, sin, cos),
        lambda q, k, v: nala_attention_reference(q, k, v, 3., 1e-6, sin, cos), [qn, kn, vn], [])
    for fn, args in ((lambda *a: polarity_attention_fast(*a, 3. * torch.ones(1, 3, 1, 8)),
                      (q, k, v)),
                     (lambda *a: nala_attention_fast(*a, 3., 1e-6, sin, cos), (qn, kn, vn))):
        halves = [t.detach().bfloat16().requires_grad_() for t in args]
        kept = {st.untyped_storage().data_ptr() for st in halves}
        dtypes, tokens = [], args[0].shape[-2]

        def pack(t):
            if t.dim() == 4 and t.shape[-2] == tokens:  # token maps, not the small matrices
                dtypes.append(t.dtype)
                assert t.untyped_storage().data_ptr() in kept
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*halves)
        assert dtypes and set(dtypes) == {torch.bfloat16}


def test_lean_layers_take_half_precision_inputs_as_they_are():
    """``DepthwiseConvTokens`` with bfloat16 tokens and a float32 kernel computes in float32 (both
    backward forms), ``NormGatedLinear`` with a bfloat16 gate takes its SiLU in float32: both
    equal plain autograd on float32 copies."""
    g = torch.Generator().manual_seed(4)
    B, H, W, C = 2, 5, 6, 8
    v = rand(B, H * W, C, dtype=torch.float32, g=g)
    wt = rand(C, 1, 5, 5, dtype=torch.float32, g=g, scale=0.2)
    bt = rand(C, dtype=torch.float32, g=g)

    def conv_plain(v, wt, bt):
        m = v.reshape(B, H, W, C).permute(0, 3, 1, 2)
        return F.conv2d(m, wt, bt, padding=(2, 2), groups=C).flatten(2).transpose(1, 2)
    for form in CONV_BACKWARD_FORMS:
        _half_inputs_against_float32(
            lambda v, wt, bt: DepthwiseConvTokens.apply(v, (H, W), wt, bt, (2, 2), 2, form),
            conv_plain, [v], [wt, bt])
    s, gate = rand(B, 7, C, dtype=torch.float32, g=g), rand(B, 7, C, dtype=torch.float32, g=g)
    lw, lb = rand(5, C, dtype=torch.float32, g=g), rand(5, dtype=torch.float32, g=g)
    nw, nb = 1 + rand(C, dtype=torch.float32, g=g, scale=0.1), rand(C, dtype=torch.float32, g=g)
    _half_inputs_against_float32(
        lambda gt, s, nw, nb, w, b: NormGatedLinear.apply(s, nw, nb, 1e-5, gt, w, b),
        lambda gt, s, nw, nb, w, b: F.linear(F.layer_norm(s, (C, ), nw, nb, 1e-5) * F.silu(gt),
                                             w, b), [gate], [s, nw, nb, lw, lb])


@pytest.mark.parametrize('cfg,bound', [(dict(type='PolaLinearAttention', qkv_layout='qkvg'), 4),
                                       (NALA, 5), (SOFT, 7)])
def test_lean_mixer_under_autocast_keeps_the_half_precision_projection(cfg, bound):
    """Under bfloat16 autocast the lean linear mixers keep the half-precision projection, not
    float32 copies of q, k, v (and g): in float32 token maps of C values Pola 3.5 and NaLa 4.6
    (6.5 and 6.6 with the float32 copies). NaLa's softmax mixer keeps float32 v and g for its
    LePE and gate, and its attention (in bfloat16 under autocast, as the released block's
    matmuls) bfloat16 copies, not the projection besides: 6.7 (7.7 with a float32 attention)."""
    C, h, H, W = 32, 4, 32, 32
    m = build_attention(cfg, embed_dims=C, num_heads=h, pretrain_hw=(H, W))
    x = torch.randn(1, H * W, C, requires_grad=True)
    token_map = H * W * C * 4
    fp32 = saved_bytes(lambda: m(x, (H, W)), m.parameters()) / token_map
    with torch.autocast('cpu', dtype=torch.bfloat16):
        half = saved_bytes(lambda: m(x, (H, W)), m.parameters()) / token_map
    assert half < bound < fp32, (half, fp32)


def test_a_lower_precision_twin_is_kept_instead_of_the_input():
    """``keep`` / ``v_keep``: the conv and the NaLa core read and keep the bfloat16 twin of their
    float32 input instead of it (the NaLa mixer's v feeds both, so that its two gradients are
    summed in float32): the outputs and all gradients are those without the twin, exactly, and
    the float32 input is not kept."""
    g = torch.Generator().manual_seed(6)
    B, H, W, C = 2, 5, 6, 8
    low = torch.randn(B, H * W, C, generator=g).bfloat16()
    wt = rand(C, 1, 5, 5, dtype=torch.float32, g=g, scale=0.2)
    qn, kn, _, sin, cos = _nala_inputs(8, torch.float32, True)
    low_h = torch.randn(qn.shape, generator=g).bfloat16()
    cases = ((lambda v, keep: DepthwiseConvTokens.apply(v, (H, W), wt, None, (2, 2), 2, None,
                                                        keep), low, [wt]),
             (lambda v, keep: nala_attention_fast(qn, kn, v, 3., 1e-6, sin, cos, v_keep=keep),
              low_h, [qn, kn]),
             (lambda v, keep: nala_attention_fast(qn, kn, v, 3., 1e-6, sin, cos, v_keep=keep,
                                                  rows=7), low_h, [qn, kn]))  # in chunks
    for fn, twin, others in cases:
        results = []
        for keep in (None, twin):
            v = twin.float().requires_grad_()
            for t in others:
                t.grad = None
            kept = set()

            def pack(t):
                kept.add(t.untyped_storage().data_ptr())
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = fn(v, keep)
            assert (v.untyped_storage().data_ptr() in kept) == (keep is None)
            (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
            results.append([out.detach(), v.grad] + [t.grad for t in others])
        for a, b in zip(*results):
            assert a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(ValueError, match=r"DepthwiseConvTokens: the kept twin must have the "
                       r"input's shape \(2, 30, 8\), got \(2, 29, 8\)"):
        DepthwiseConvTokens.apply(low.float(), (H, W), wt, None, (2, 2), 2, None, low[:, :29])
    with pytest.raises(ValueError, match=r"NormAwareAttention: the kept twin must have the "
                       r"input's shape"):
        nala_attention_fast(qn, kn, low_h.float(), 3., 1e-6, sin, cos, v_keep=low_h[:, :, 1:])


def test_nala_core_refuses_keys_or_values_of_another_shape():
    """The NaLa core attends over its own tokens (q, k, v of one shape, as the reference's
    ``N^-1/2`` scaling and the RoPE tables assume): fewer keys, or values of another head dim,
    are refused by name, in one chunk and in chunks alike."""
    q, k, v, sin, cos = _nala_inputs(10, torch.float64, False)
    for rows in (None, 7):
        for kk, vv in ((k[:, :, :20], v[:, :, :20]), (k, v[..., :6])):
            with pytest.raises(ValueError, match=r'nala_attention_fast: q, k, v must be '
                               r'\(B, h, N, d\) of one shape'):
                nala_attention_fast(q, kk, vv, 3., 1e-6, rows=rows)


def test_nala_core_chunks_read_half_precision_inputs():
    """bfloat16 q, k, v (the projections under autocast) are cast chunk by chunk: in chunks of 7
    tokens the output and the gradients are those of one chunk up to float32 rounding, in the
    inputs' dtypes."""
    q, k, v, sin, cos = _nala_inputs(9, torch.float32, True)
    results = []
    for rows in (None, 7):
        leaves = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
        out = nala_attention_fast(*leaves, 3., 1e-6, sin, cos, rows=rows)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        assert out.dtype == torch.float32 and all(t.grad.dtype == torch.bfloat16 for t in leaves)
        results.append([out.detach()] + [t.grad.float() for t in leaves])
    for a, b in zip(*results):
        assert rel(a, b) < 1e-2, rel(a, b)  # the gradients rounded to bfloat16 once each way
    assert rel(results[0][0], results[1][0]) < 1e-5


def test_core_dtypes_with_mixed_inputs():
    """The result of every torch core has the dtype of v (bfloat16 inputs under autocast, both
    cores), and the fast Pola core computes in float64 for float64 q, k, v with a float32 ``p``."""
    from linattn_mm.ops.nala import nala_attention
    from linattn_mm.ops.pola import polarity_attention
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g) for _ in range(3))
    p = 1 + 4 * torch.rand(1, 2, 1, 8, generator=g)
    for core in ('fast', 'reference'):
        with torch.autocast('cpu', dtype=torch.bfloat16):
            assert polarity_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), p,
                                      core=core).dtype == torch.bfloat16
            assert nala_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                  core=core).dtype == torch.bfloat16
    q, k, v = q.double(), k.double(), v.double()
    out = polarity_attention_fast(q, k, v, p)
    assert out.dtype == torch.float64
    assert rel(out, polarity_attention_reference(q, k, v, p.double())) < 1e-12
