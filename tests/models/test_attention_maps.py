"""Attention weights of every family (linattn_mm.analysis and each mixer's ``attention_weights``):
the weights returned are the ones the mixer applies, so multiplying them with the mixer's own
values reproduces its forward output; influence maps equal the norms of the full Jacobian; the
entropy matches its formula."""
import math

import pytest
import torch
import torch.nn.functional as F

import linattn_mm  # noqa: F401
from linattn_mm.analysis import (attention_entropy, attention_map, capture_mixer_inputs,
                                 find_mixers, influence_map, query_index)
from linattn_mm.models.attentions import build_attention
from linattn_mm.models.attentions.base import merge_heads, split_heads

C, HEADS = 32, 2


def _mixer(cfg, **context):
    torch.manual_seed(0)
    m = build_attention(cfg, embed_dims=C, num_heads=HEADS, **context)
    m.init_weights()
    for p in m.parameters():  # non-trivial values everywhere (biases, tables, gates)
        p.data.add_(0.05 * torch.randn_like(p))
    return m.double().eval()


def _tokens(hw, extra=0, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, extra + hw[0] * hw[1], C, generator=g, dtype=torch.float64)


def _rows_sum_to_one(w):
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)), atol=1e-6, rtol=0)


@pytest.mark.parametrize('extra', [0, 1])
def test_global_softmax_weights_reproduce_forward(extra):
    m = _mixer(dict(type='GlobalSoftmaxAttention'), num_extra_tokens=extra)
    x, hw = _tokens((5, 6), extra), (5, 6)
    w = m.attention_weights(x, hw)
    assert w['weights'].shape == (2, HEADS, extra + 30, extra + 30) and w['key_hw'] == hw
    _rows_sum_to_one(w['weights'])
    v = split_heads(m.qkv(x), HEADS * 3).chunk(3, dim=1)[2]
    torch.testing.assert_close(m.proj(merge_heads(w['weights'] @ v)), m(x, hw))


@pytest.mark.parametrize('cfg,key_hw', [
    (dict(type='SRSoftmaxAttention', sr_ratio=2), (4, 5)),
    (dict(type='SRSoftmaxAttention', sr_ratio=1), (8, 11)),
    (dict(type='SRSoftmaxAttention', linear=True), (7, 7)),
])
def test_sr_softmax_weights_on_the_reduced_grid(cfg, key_hw):
    m = _mixer(cfg)
    x, hw = _tokens((8, 11)), (8, 11)
    w = m.attention_weights(x, hw)
    assert w['key_hw'] == key_hw
    assert w['weights'].shape == (2, HEADS, 88, key_hw[0] * key_hw[1])
    _rows_sum_to_one(w['weights'])
    v = split_heads(m.kv(m.reduce(x, hw)), HEADS * 2).chunk(2, dim=1)[1]
    torch.testing.assert_close(m.proj(merge_heads(w['weights'] @ v)), m(x, hw))


@pytest.mark.parametrize('block_idx', [0, 1], ids=['W-MSA', 'SW-MSA'])
def test_window_weights_are_the_shifted_windows(block_idx):
    m = _mixer(dict(type='WindowSoftmaxAttention', window_size=4), block_idx=block_idx)
    hw = (8, 12)
    x = _tokens(hw)
    w = m.attention_weights(x, hw)['weights']
    assert w.shape == (2, HEADS, 96, 96)
    _rows_sum_to_one(w)  # no padding at 8x12 with 4x4 windows
    v = split_heads(m.qkv(x), HEADS * 3).chunk(3, dim=1)[2]
    torch.testing.assert_close(m.proj(merge_heads(w @ v)), m(x, hw))
    # support: W-MSA = the 4x4 window of the query; SW-MSA = tokens of the same shifted window and
    # the same region of the cyclic shift (written out from the Swin definition)
    r, c = torch.meshgrid(torch.arange(8), torch.arange(12), indexing='ij')
    r, c = r.reshape(-1), c.reshape(-1)
    if block_idx == 0:
        win = (r // 4) * 3 + c // 4
        same = win[:, None] == win[None, :]
    else:
        rs, cs = (r - 2) % 8, (c - 2) % 12  # position in the shifted frame
        win = (rs // 4) * 3 + cs // 4
        reg_r = torch.where(rs < 4, 0, torch.where(rs < 6, 1, 2))
        reg_c = torch.where(cs < 8, 0, torch.where(cs < 10, 1, 2))
        reg = reg_r * 3 + reg_c
        same = (win[:, None] == win[None, :]) & (reg[:, None] == reg[None, :])
    assert torch.equal(w[0, 0] > 1e-30, same)


def test_window_weights_with_padding_drop_padded_keys():
    m = _mixer(dict(type='WindowSoftmaxAttention', window_size=4), block_idx=1)
    w = m.attention_weights(_tokens((6, 7)), (6, 7))['weights']
    assert w.shape == (2, HEADS, 42, 42)
    s = w.sum(-1)
    assert (s <= 1 + 1e-9).all() and (s < 1 - 1e-6).any() and (s > 1 - 1e-9).any()


@pytest.mark.parametrize('cfg', [
    dict(type='PolaLinearAttention'),
    dict(type='PolaLinearAttention', qkv_layout='qkvg'),
    dict(type='PolaLinearAttention', la_sr_ratio=2),
])
@pytest.mark.parametrize('extra', [0, 1])
def test_pola_stream_weights_reproduce_the_core(cfg, extra):
    if extra and cfg.get('la_sr_ratio'):
        pytest.skip('class tokens with la_sr_ratio are covered by the PVT tests')
    m = _mixer(dict(cfg, core='reference'), num_extra_tokens=extra, pretrain_hw=(4, 4))
    hw = (6, 8)
    x = _tokens(hw, extra)
    w = m.attention_weights(x, hw)
    n_keys = extra + w['key_hw'][0] * w['key_hw'][1]
    assert w['same'].shape == (2, HEADS, extra + 48, n_keys)
    assert (w['same'] >= 0).all() and (w['opposite'] >= 0).all()
    # rows sum to q.mean(k) / (q.mean(k) + eps): 1 up to eps over a small denominator
    torch.testing.assert_close(w['same'].sum(-1), torch.ones(2, HEADS, extra + 48,
                               dtype=torch.float64), atol=1e-3, rtol=0)
    torch.testing.assert_close(w['weights'], (w['same'] + w['opposite']) / 2)
    # the core the module computes (its own reference path) is [A_same v_s, A_opp v_o]
    q, k, v, _, kv_hw = m._project(x, hw)
    pe = F.pad(m.pos_enc(kv_hw), (0, 0, extra, 0)) if m.use_pos_enc else None
    core = split_heads(m.attend(q, k, v, pe), HEADS)
    vs, vo = split_heads(v, HEADS).chunk(2, dim=-1)
    torch.testing.assert_close(core, torch.cat([w['same'] @ vs, w['opposite'] @ vo], -1))


@pytest.mark.parametrize('kernel', ['official', 'paper'])
@pytest.mark.parametrize('use_rope', [True, False])
def test_nala_weights_reproduce_forward(kernel, use_rope):
    m = _mixer(dict(type='NormAwareLinearAttention', kernel=kernel, use_rope=use_rope))
    hw = (6, 5)
    x = _tokens(hw)
    w = m.attention_weights(x, hw)['weights']
    assert w.shape == (2, HEADS, 30, 30)
    q, k, v, g, lepe, _ = m._project(x, hw)
    torch.testing.assert_close(m.gated_output(w @ v, lepe, g), m(x, hw))
    if not use_rope:  # without the rotation the weights are a non-negative normalised kernel
        assert (w >= 0).all()
        torch.testing.assert_close(w.sum(-1), torch.ones(2, HEADS, 30, dtype=torch.float64),
                                   atol=1e-3, rtol=0)  # 1 up to eps


def test_nala_softmax_weights_reproduce_forward():
    m = _mixer(dict(type='NaLaSoftmaxAttention'))
    hw = (4, 6)
    x = _tokens(hw)
    w = m.attention_weights(x, hw)['weights']
    _rows_sum_to_one(w)
    q, k, v, g, lepe, _ = m._project(x, hw)
    torch.testing.assert_close(m.gated_output(w @ v, lepe, g), m(x, hw))


@pytest.mark.parametrize('position', ['kernel', 'plan'])
@pytest.mark.parametrize('row_normalize', [True, False])
def test_setformer_weights_reproduce_forward(row_normalize, position):
    m = _mixer(dict(type='SeTAttention', num_refs=8, num_iters=10, row_normalize=row_normalize,
                    position=position))
    hw = (4, 5)
    x = _tokens(hw)
    w = m.attention_weights(x, hw)['weights']
    assert w.shape == (2, HEADS, 20, 20)
    if position == 'kernel':  # the plan keeps its marginals: T Tᵀ has near-constant row sums
        torch.testing.assert_close(w, w.transpose(-1, -2) * (
            w.sum(-1, keepdim=True) if row_normalize else 1) / (
            w.sum(-2, keepdim=True).transpose(-1, -2) if row_normalize else 1))  # A ∝ T Tᵀ
    else:  # A = T Tᵀ / its row sums (or times N·m), T the plan without M times M_ij
        bare = _mixer(dict(type='SeTAttention', num_refs=8, num_iters=10, tau=None,
                           row_normalize=row_normalize))
        bare.load_state_dict(m.state_dict())
        i = torch.arange(20, dtype=x.dtype)[:, None] / 20
        j = torch.arange(8, dtype=x.dtype)[None] / 8
        plan = bare.transport_plan(x, hw) * torch.exp(-(i - j) ** 2 / m.tau)
        a = plan @ plan.transpose(-1, -2)
        torch.testing.assert_close(w, a / a.sum(-1, keepdim=True) if row_normalize else a * 160)
    v = split_heads(m.v(x), HEADS)
    torch.testing.assert_close(m.proj(merge_heads(w @ v)), m(x, hw))


@pytest.mark.parametrize('cfg', [dict(type='PADReMixer', degree=2),
                                 dict(type='PolySelfAttention')])
def test_influence_map_is_the_jacobian_norm(cfg):
    m = _mixer(cfg)
    hw = (3, 4)
    x = _tokens(hw)
    assert not m.has_attention_weights
    with pytest.raises(NotImplementedError, match='influence_map'):
        m.attention_weights(x, hw)
    queries = [0, 5, 11]
    got = attention_map(m, x, hw, queries)
    assert got['kind'] == 'influence' and got['weights'].shape == (1, 3, 12)
    jac = torch.autograd.functional.jacobian(lambda t: m(t, hw)[0], x[:1])  # (N, C, 1, N, C)
    want = jac[:, :, 0].pow(2).sum(dim=(1, 3)).sqrt()[queries]
    torch.testing.assert_close(got['weights'][0], want)
    with pytest.raises(ValueError, match='query indices'):
        attention_map(m, x, hw)


def test_entropy_formula():
    uniform = torch.full((2, 3, 16), 1 / 16)
    assert attention_entropy(uniform) == pytest.approx(math.log(16))
    assert attention_entropy(uniform, normalized=True) == pytest.approx(1.0)
    peaked = torch.zeros(1, 4, 16)
    peaked[..., 3] = 1
    assert attention_entropy(peaked) == pytest.approx(0.0)
    two = torch.tensor([[0.5, -0.5, 0, 0]])  # signed: magnitudes
    assert attention_entropy(two) == pytest.approx(math.log(2))


def test_capture_and_query_index_in_a_backbone():
    from linattn_mm.models.backbones import LinAttnSwin
    torch.manual_seed(0)
    model = LinAttnSwin(arch=dict(embed_dims=16, depths=[2, 2], num_heads=[1, 2]),
                        out_indices=(0, 1), attn_cfg=[dict(type='PolaLinearAttention',
                                                          qkv_layout='qkvg'),
                                                     dict(type='WindowSoftmaxAttention')]).eval()
    rec = capture_mixer_inputs(model, torch.randn(1, 3, 64, 96))
    names = [n for n, _ in find_mixers(model)]
    assert list(rec) == names and len(names) == 4
    x, hw, _ = rec[names[0]]
    assert hw == (16, 24) and x.shape == (1, 16 * 24, 16)
    assert rec[names[2]][1] == (8, 12)
    mixer = dict(find_mixers(model))[names[0]]
    assert query_index(mixer, hw, (0.5, 0.5)) == 8 * 24 + 12
    assert query_index(mixer, hw, (1.0, 1.0)) == 16 * 24 - 1
