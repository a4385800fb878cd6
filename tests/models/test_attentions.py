"""Softmax reference mixers against direct implementations written from the formulas (float64)."""
import math

import pytest
import torch
import torch.nn.functional as F

from harness import assert_inference_only, record_calls

from linattn_mm import deploy
from linattn_mm.models.attentions import (GlobalSoftmaxAttention, SRSoftmaxAttention,
                                          WindowSoftmaxAttention, build_attention,
                                          list_attentions)


def naive_mha(q, k, v, bias=None):
    """q, k, v: (h, N, d) float64; softmax(q k^T / sqrt(d) + bias) v."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias
    return torch.softmax(logits, -1) @ v


def split_heads(t, h):
    N, C = t.shape
    return t.view(N, h, C // h).transpose(0, 1)


@pytest.mark.parametrize('extra', [0, 1])
def test_global_attention_matches_formula(extra):
    torch.manual_seed(0)
    C, h, H, W = 12, 3, 3, 5
    m = GlobalSoftmaxAttention(C, h, num_extra_tokens=extra).double().eval()
    x = torch.randn(2, extra + H * W, C, dtype=torch.float64)
    out = m(x, (H, W))
    for b in range(2):
        qkv = x[b] @ m.qkv.weight.T + m.qkv.bias
        q, k, v = (split_heads(t, h) for t in qkv.split(C, -1))
        o = naive_mha(q, k, v).transpose(0, 1).reshape(-1, C)
        ref = o @ m.proj.weight.T + m.proj.bias
        torch.testing.assert_close(out[b], ref, rtol=1e-10, atol=1e-10)


def swin_reference(m, x, H, W):
    """Direct Swin (S)W-MSA: pad, roll, and for every pair of tokens in the same window add the
    relative position bias; pairs from different pre-shift regions get -100 (as Swin does)."""
    ws, s, h = m.window_size, m.shift_size, m.num_heads
    if H <= ws and W <= ws:
        s = 0  # the official Swin does not shift a map that fits in one window
    B, N, C = x.shape
    Hp, Wp = math.ceil(H / ws) * ws, math.ceil(W / ws) * ws
    grid = torch.zeros(B, Hp, Wp, C, dtype=x.dtype)
    grid[:, :H, :W] = x.view(B, H, W, C)
    rolled = torch.roll(grid, (-s, -s), (1, 2)) if s else grid

    def region(p, size):
        if not s:
            return 0
        return 0 if p < size - ws else (1 if p < size - s else 2)

    out_rolled = torch.zeros_like(rolled)
    table = m.relative_position_bias_table.detach()
    for b in range(B):
        for wy in range(Hp // ws):
            for wx in range(Wp // ws):
                coords = [(wy * ws + i, wx * ws + j) for i in range(ws) for j in range(ws)]
                toks = torch.stack([rolled[b, y, x_] for y, x_ in coords])
                n = len(coords)
                bias = torch.zeros(h, n, n, dtype=x.dtype)
                for a, (ya, xa) in enumerate(coords):
                    for c, (yc, xc) in enumerate(coords):
                        dy, dx = ya - yc, xa - xc
                        bias[:, a, c] = table[(dy + ws - 1) * (2 * ws - 1) + dx + ws - 1]
                        if (region(ya, Hp), region(xa, Wp)) != (region(yc, Hp), region(xc, Wp)):
                            bias[:, a, c] += -100.0
                qkv = toks @ m.qkv.weight.T + m.qkv.bias
                q, k, v = (split_heads(t, h) for t in qkv.split(C, -1))
                o = naive_mha(q, k, v, bias).transpose(0, 1).reshape(n, C)
                o = o @ m.proj.weight.T + m.proj.bias
                for a, (y, x_) in enumerate(coords):
                    out_rolled[b, y, x_] = o[a]
    out = torch.roll(out_rolled, (s, s), (1, 2)) if s else out_rolled
    return out[:, :H, :W].reshape(B, H * W, C)


@pytest.mark.parametrize('fused', [False, True])
@pytest.mark.parametrize('block_idx,hw', [(0, (7, 7)), (1, (7, 7)), (0, (9, 11)), (1, (9, 11)),
                                          (1, (4, 6)), (1, (3, 4))])
def test_window_attention_matches_direct_swin(block_idx, hw, fused):
    """Both forms: the steps (CPU's default) and one ``scaled_dot_product_attention`` with the
    bias as its mask (the default off CPU)."""
    torch.manual_seed(1)
    m = WindowSoftmaxAttention(8, 2, window_size=4, block_idx=block_idx).double().eval()
    m.fused = fused
    torch.nn.init.normal_(m.relative_position_bias_table, std=1.0)
    assert m.shift_size == (2 if block_idx % 2 else 0)
    H, W = hw
    x = torch.randn(2, H * W, 8, dtype=torch.float64)
    torch.testing.assert_close(m(x, hw), swin_reference(m, x, H, W), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize('fused', [False, True])
@pytest.mark.parametrize('block_idx,hw', [(0, (9, 11)), (1, (9, 11)), (1, (7, 7)), (1, (3, 4))])
def test_window_attention_gradients_match_direct_swin(block_idx, hw, fused):
    """The gradients of the input and of the projections (the qkv bias gets those of the
    padding too) equal those through the direct per-window implementation (which reads the
    bias table as a constant), in both forms."""
    torch.manual_seed(2)
    m = WindowSoftmaxAttention(8, 2, window_size=4, block_idx=block_idx).double()
    m.fused = fused
    torch.nn.init.normal_(m.relative_position_bias_table, std=1.0)
    H, W = hw
    x = torch.randn(2, H * W, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, H * W, 8, dtype=torch.float64)
    grads = []
    for fn in (lambda: m(x, hw), lambda: swin_reference(m, x, H, W)):
        m.zero_grad()
        x.grad = None
        (fn() * w).sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in (
            m.qkv.weight, m.qkv.bias, m.proj.weight, m.proj.bias)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize('block_idx,hw', [(0, (9, 11)), (1, (9, 11)), (1, (7, 7)), (1, (3, 4))])
def test_window_attention_fused_form_equals_the_steps(block_idx, hw):
    """One ``scaled_dot_product_attention`` with the relative position bias (and each window's
    shift mask) as its mask, against the steps: outputs and the gradients of every parameter, the
    bias table's included, float64 to 1e-10; batch 3, so that the per-window masks of shifted
    windows repeat over the images."""
    torch.manual_seed(3)
    m = WindowSoftmaxAttention(8, 2, window_size=4, block_idx=block_idx).double().train()
    torch.nn.init.normal_(m.relative_position_bias_table, std=1.0)
    H, W = hw
    x = torch.randn(3, H * W, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, H * W, 8, dtype=torch.float64)
    res = []
    for fused in (False, True):
        m.fused = fused
        m.zero_grad()
        x.grad = None
        y = m(x, hw)
        (y * w).sum().backward()
        res.append([y.detach(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    assert res[1][2].abs().sum() > 0  # the bias table's gradient (the first parameter)
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('block_idx,hw', [(0, (9, 11)), (1, (9, 11)), (1, (7, 7)), (1, (4, 6))])
@pytest.mark.parametrize('group_tokens', [40, 10_000])  # 2 windows per group; all in one group
def test_window_attention_grouped_inference_matches_direct_swin(block_idx, hw, group_tokens,
                                                                monkeypatch):
    """The CPU inference form runs the windows group by group (groups span two images here)."""
    import linattn_mm.deploy.mixers as mixers_mod
    monkeypatch.setattr(mixers_mod, 'WINDOW_GROUP_TOKENS', group_tokens)
    calls = record_calls(monkeypatch, mixers_mod.WindowSoftmaxAttentionCPU, 'forward')
    torch.manual_seed(1)
    m = WindowSoftmaxAttention(8, 2, window_size=4, block_idx=block_idx).double().eval()
    torch.nn.init.normal_(m.relative_position_bias_table, std=1.0)
    H, W = hw
    x = torch.randn(3, H * W, 8, dtype=torch.float64)
    deploy.convert(m)
    assert type(m) is mixers_mod.WindowSoftmaxAttentionCPU
    with torch.no_grad():
        got = m(x, hw)
    assert calls == [(3, H * W, 8)]
    torch.testing.assert_close(got, swin_reference(m, x, H, W), rtol=1e-9, atol=1e-9)
    assert_inference_only(m, lambda: m(x, hw), lambda: m.float()(x.float(), hw))
    refused = len(calls)  # the refused calls entered the inference form's forward
    deploy.revert(m.double())
    m(x, hw)  # the plain form again: gradients, training mode
    assert len(calls) == refused


def test_window_attention_shift_option():
    assert WindowSoftmaxAttention(8, 2, window_size=4, shift=True, block_idx=0).shift_size == 2
    assert WindowSoftmaxAttention(8, 2, window_size=4, shift=False, block_idx=1).shift_size == 0
    with pytest.raises(ValueError, match='shift'):
        WindowSoftmaxAttention(8, 2, shift='sometimes')


@pytest.mark.parametrize('sr,linear,extra', [(1, False, 0), (2, False, 0), (2, False, 1),
                                             (1, True, 0)])
def test_sr_attention_matches_formula(sr, linear, extra):
    torch.manual_seed(2)
    C, h, H, W = 8, 2, 6, 8
    m = SRSoftmaxAttention(C, h, sr_ratio=sr, linear=linear, num_extra_tokens=extra).double()
    m.eval()
    x = torch.randn(2, extra + H * W, C, dtype=torch.float64)
    out = m(x, (H, W))
    for b in range(2):
        grid = x[b, extra:].T.reshape(1, C, H, W)
        if linear:
            red = F.conv2d(F.adaptive_avg_pool2d(grid, 7), m.sr.weight, m.sr.bias)
            red = F.gelu(F.layer_norm(red.flatten(2)[0].T, (C, ), m.norm.weight, m.norm.bias))
        elif sr > 1:
            red = F.conv2d(grid, m.sr.weight, m.sr.bias, stride=sr)
            red = F.layer_norm(red.flatten(2)[0].T, (C, ), m.norm.weight, m.norm.bias)
        else:
            red = x[b, extra:]
        kv_src = torch.cat([x[b, :extra], red]) if extra and (sr > 1 or linear) else (
            x[b] if not (sr > 1 or linear) else red)
        q = split_heads(x[b] @ m.q.weight.T + m.q.bias, h)
        kv = kv_src @ m.kv.weight.T + m.kv.bias
        k, v = (split_heads(t, h) for t in kv.split(C, -1))
        ref = naive_mha(q, k, v).transpose(0, 1).reshape(-1, C) @ m.proj.weight.T + m.proj.bias
        torch.testing.assert_close(out[b], ref, rtol=1e-10, atol=1e-10)


def test_sr_attention_too_small_grid():
    m = SRSoftmaxAttention(8, 2, sr_ratio=4)
    with pytest.raises(ValueError, match='smaller than sr_ratio=4'):
        m(torch.randn(1, 9, 8), (3, 3))


def test_input_shape_is_checked():
    m = GlobalSoftmaxAttention(8, 2)
    with pytest.raises(ValueError, match=r'hw_shape=\(3, 3\)'):
        m(torch.randn(1, 10, 8), (3, 3))


def test_build_attention_context_and_errors():
    m = build_attention(dict(type='WindowSoftmaxAttention', window_size=3), embed_dims=8,
                        num_heads=2, block_idx=1, sr_ratio=8, num_extra_tokens=0)
    assert isinstance(m, WindowSoftmaxAttention) and m.shift_size == 1  # sr_ratio ignored
    m = build_attention(dict(type='SRSoftmaxAttention'), embed_dims=8, num_heads=2, sr_ratio=4)
    assert m.sr_ratio == 4
    m = build_attention(dict(type='SRSoftmaxAttention', sr_ratio=2), embed_dims=8, num_heads=2,
                        sr_ratio=4)
    assert m.sr_ratio == 2  # the user's option wins over the skeleton's context
    with pytest.raises(KeyError, match='valid types: .*GlobalSoftmaxAttention'):
        build_attention(dict(type='NoSuchAttention'), embed_dims=8, num_heads=2)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['windowsize'\].*window_size"):
        build_attention(dict(type='WindowSoftmaxAttention', windowsize=7), embed_dims=8,
                        num_heads=2)
    with pytest.raises(ValueError, match='not divisible'):
        build_attention(dict(type='GlobalSoftmaxAttention'), embed_dims=10, num_heads=3)
    with pytest.raises(ValueError, match='extra'):
        build_attention(dict(type='WindowSoftmaxAttention'), embed_dims=8, num_heads=2,
                        num_extra_tokens=1)
    assert {'GlobalSoftmaxAttention', 'SRSoftmaxAttention',
            'WindowSoftmaxAttention'} <= set(list_attentions())


@pytest.mark.parametrize('B', [1, 3])
def test_token_map_views_are_channels_last(B):
    """``nlc_to_nchw`` views contiguous tokens as a map with channels-last strides, batch stride
    included (for B = 1 too, so that a conv takes the map as it is instead of copying it to
    NCHW), and ``nchw_to_nlc`` undoes it."""
    from linattn_mm.models.utils.layers import nchw_to_nlc, nlc_to_nchw
    x = torch.randn(B, 6 * 7, 5)
    m = nlc_to_nchw(x, (6, 7))
    assert m.shape == (B, 5, 6, 7) and m.data_ptr() == x.data_ptr()
    assert m.stride() == (6 * 7 * 5, 1, 7 * 5, 5)
    assert torch.equal(m[:, :, 2, 3], x[:, 2 * 7 + 3])
    assert torch.equal(nchw_to_nlc(m), x)


def test_window_attention_form_by_device(monkeypatch):
    """By default the windows attend step by step on CPU and through one fused
    ``scaled_dot_product_attention`` elsewhere (``meta`` here: the GPU path), whose mask is one
    (B*nW, h, n, n) sum for shifted windows."""
    import linattn_mm.models.attentions.softmax as softmax_mod
    masks = []
    sdpa = softmax_mod.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        masks.append(tuple(attn_mask.shape))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(softmax_mod.F, 'scaled_dot_product_attention', spy)
    for device, want in (('cpu', []), ('meta', [(2 * 9, 2, 16, 16)])):
        m = WindowSoftmaxAttention(8, 2, window_size=4, block_idx=1).to(device)
        m(torch.randn(2, 9 * 11, 8, device=device), (9, 11))
        assert masks == want, device
        masks.clear()


def test_fused_window_attention_keeps_to_kernels_with_a_mask_gradient(monkeypatch):
    """Where the bias needs a gradient (training), the fused form runs with cuDNN's attention
    (no gradient for a mask) and flash attention (no mask) switched off: the memory-efficient
    kernel or the decomposition; without one (inference) torch's own choice."""
    import linattn_mm.models.attentions.softmax as softmax_mod
    states = []
    sdpa = softmax_mod.F.scaled_dot_product_attention

    def spy(*args, **kw):
        states.append((torch.backends.cuda.cudnn_sdp_enabled(),
                       torch.backends.cuda.flash_sdp_enabled(),
                       torch.backends.cuda.mem_efficient_sdp_enabled()))
        return sdpa(*args, **kw)
    monkeypatch.setattr(softmax_mod.F, 'scaled_dot_product_attention', spy)
    m = WindowSoftmaxAttention(8, 2, window_size=4, block_idx=1)
    m.fused = True
    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled())
    x = torch.randn(2, 9 * 11, 8)
    m(x, (9, 11)).sum().backward()
    with torch.no_grad():
        m(x, (9, 11))
    assert states == [(False, False, True), before]
