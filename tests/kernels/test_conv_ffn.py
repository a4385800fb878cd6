"""NaLaFormer's inference forms (:func:`linattn_mm.deploy.convert`): the banded in-place ConvFFN
kernel (:func:`linattn_mm.ops.ffn.conv_ffn_residual_`) against the formula written out here, its
use in the converted ``NaLaBlock``, the channels-last maps and the in-place BatchNorm / GELU of the
stem and the patch merging, all against the plain (training-graph) form."""
import math

import pytest
import torch
from harness import assert_inference_only, record_calls
from oracles.ffn import hidden_formula

import linattn_mm.deploy.blocks as deploy_blocks
import linattn_mm.ops.ffn as ffn_ops
from linattn_mm import deploy
from linattn_mm.models.backbones import nalaformer as nf
from linattn_mm.ops.ffn import conv_ffn_residual_

ATTN = {'nala': dict(type='NormAwareLinearAttention'), 'released': nf.RELEASED_ATTN_CFG}


def conv_ffn_formula(x, ln_w, ln_b, eps, w1, b1, dw, db, w2, b2, scale, approximate='none'):
    """``x + scale * fc2(h + dwconv3x3(h))``, ``h = gelu(fc1(LN_C(x)))``, every step from its
    definition on an NCHW float64 map (the conv as nine shifted products over a zero border)."""
    h = hidden_formula(x.permute(0, 2, 3, 1), ln_w, ln_b, eps, w1, b1, approximate)  # (B, H, W, r)
    H, W = h.shape[1:3]
    hp = torch.zeros(h.shape[0], H + 2, W + 2, h.shape[3], dtype=h.dtype)
    hp[:, 1:-1, 1:-1] = h
    conv = sum(hp[:, i:i + H, j:j + W] * dw[:, 0, i, j] for i in range(3) for j in range(3))
    if db is not None:
        conv = conv + db
    f = (h + conv) @ w2.T + (0 if b2 is None else b2)
    if scale is not None:
        f = f * scale
    return x + f.permute(0, 3, 1, 2)


def conv_ffn_params(C, hidden, bias=True, affine=True, scale=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return ((1 + 0.3 * r(C)) if affine else None, 0.3 * r(C) if affine else None, 1e-6,
            r(hidden, C) / math.sqrt(C), 0.2 * r(hidden) if bias else None,
            r(hidden, 1, 3, 3) / 3, 0.2 * r(hidden) if bias else None,
            r(C, hidden) / math.sqrt(hidden), 0.2 * r(C) if bias else None,
            (0.5 + r(C).abs()) if scale else None)


def channels_last(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize('shape,hidden,rows', [
    ((2, 6, 7, 5), 12, None),  # one band per image
    ((1, 6, 7, 5), 12, 2),  # bands of 2 rows, a last band of 1
    ((1, 6, 7, 5), 12, 3),
    ((2, 4, 9, 4), 8, 1),  # one row per band (the carried rows overlap)
    ((1, 4, 1, 6), 8, None),  # a single row: zero rows above and below
    ((1, 4, 5, 3), 8, 7),  # more rows per band than the map has
    ((1, 4, 8, 3), 8, 4)])  # the bands end on the last row
@pytest.mark.parametrize('bias,affine,scale,approximate', [
    (True, True, True, 'none'), (False, False, False, 'none'), (True, True, False, 'tanh')])
def test_kernel_matches_formula(shape, hidden, rows, bias, affine, scale, approximate):
    p = conv_ffn_params(shape[1], hidden, bias, affine, scale)
    x = channels_last(*shape)
    want = conv_ffn_formula(x, *p, approximate)
    got = x.clone(memory_format=torch.channels_last)
    out = conv_ffn_residual_(got, *p, approximate=approximate, rows=rows)
    assert out is got  # in place
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-12, err


def test_kernel_default_bands_float32_equal_plain_modules():
    """Several bands of the default size (2048 tokens: 25 rows of 80) against the plain ConvFFN
    and LayerNorm modules run on the whole map, in float32."""
    torch.manual_seed(0)
    ffn, norm = nf.ConvFFN(16, 48), nf.LayerNorm2d(16)
    x = channels_last(1, 16, 64, 80, dtype=torch.float32)
    scale = torch.rand(16) + 0.5
    with torch.no_grad():
        want = x + scale.view(1, -1, 1, 1) * ffn(norm(x))
        got = conv_ffn_residual_(x.clone(memory_format=torch.channels_last), norm.norm.weight,
                                 norm.norm.bias, norm.norm.eps, ffn.fc1.weight, ffn.fc1.bias,
                                 ffn.dwconv.weight, ffn.dwconv.bias, ffn.fc2.weight,
                                 ffn.fc2.bias, scale)
    assert ffn_ops.CPU_BAND_TOKENS // 80 < 64  # more than one band
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err


def test_kernel_rejects_bad_input():
    p = conv_ffn_params(4, 8)
    with pytest.raises(ValueError, match='must be a channels-last'):
        conv_ffn_residual_(torch.randn(1, 4, 5, 5, dtype=torch.float64), *p)  # NCHW
    # channels-last strides except the batch stride (what a reshape of a transpose gives at B = 1)
    odd = torch.randn(1, 25, 4, dtype=torch.float64).transpose(1, 2).reshape(1, 4, 5, 5)
    assert odd.stride(0) != 100
    with pytest.raises(ValueError, match='must be a channels-last'):
        conv_ffn_residual_(odd, *p)
    with pytest.raises(ValueError, match='do not make a 6-channel ConvFFN'):
        conv_ffn_residual_(channels_last(1, 6, 5, 5), *p)
    with pytest.raises(ValueError, match='rows must be positive'):
        conv_ffn_residual_(channels_last(1, 4, 5, 5), *p, rows=0)


def small_nalaformer(attn='nala', seed=0):
    arch = dict(embed_dims=[16, 32, 32, 64], depths=[1, 2, 1, 1], num_heads=[1, 2, 2, 4],
                mlp_ratios=[2, 2, 2, 2], layer_scale_init_values=[0.5] * 4)
    torch.manual_seed(seed)
    net = nf.NaLaFormer(arch=arch, attn_cfg=ATTN[attn]).double().eval()
    with torch.no_grad():  # layer scales and BatchNorm statistics away from their initial values
        for name, p in net.named_parameters():
            if name.endswith('gamma_1') or name.endswith('gamma_2'):
                p.uniform_(0.5, 1.5)
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.3)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.3)
    return net


@pytest.mark.parametrize('band_tokens,attn', [(2048, 'nala'), (30, 'nala'), (30, 'released')])
def test_nalaformer_inference_equals_plain_form(band_tokens, attn, monkeypatch):
    """CPU inference: channels-last maps, the residual sums in place, BatchNorm and GELU in place
    after the stem and merging convs, the banded ConvFFN (one band per map, or bands of one or
    two rows) give the maps of the plain form (autograd on), layer scales and BatchNorm
    statistics included."""
    monkeypatch.setattr(ffn_ops, 'CPU_BAND_TOKENS', band_tokens)
    calls = record_calls(monkeypatch, deploy_blocks, 'conv_ffn_residual_')
    net = small_nalaformer(attn)
    x = torch.randn(1, 3, 70, 90, dtype=torch.float64)
    plain = net(x)
    assert calls == []  # not in the plain form
    deploy.convert(net)
    assert {type(m).__name__ for m in net.modules() if isinstance(m, deploy.InferenceForm)} >= {
        'ConvStemCPU', 'ConvPatchMergingCPU', 'NaLaBlockCPU'}
    with torch.no_grad():
        fast = net(x)
    # one call per block, on channels-last maps of the stage sizes (18 x 23 after the stem)
    assert calls == [(1, 16, 18, 23), (1, 32, 9, 12), (1, 32, 9, 12), (1, 32, 5, 6),
                     (1, 64, 3, 3)]
    assert all(o.is_contiguous(memory_format=torch.channels_last) for o in fast)
    for a, b in zip(fast, plain):
        assert ((a - b.detach()).abs().max() / b.abs().max()).item() < 1e-12


def test_block_ffn_plain_where_the_kernel_cannot_run_and_errors(monkeypatch):
    calls = record_calls(monkeypatch, deploy_blocks, 'conv_ffn_residual_')
    net = small_nalaformer()
    blk, rope = net.layers[0].blocks[0], net.layers[0].RoPE((6, 7))
    x = channels_last(1, 16, 6, 7)
    with torch.no_grad():
        plain = blk(x, rope)
        assert calls == []
        deploy.convert(blk)
        assert ((blk(x, rope) - plain).abs().max() / plain.abs().max()).item() < 1e-12
        assert calls == [(1, 16, 6, 7)]
        # an NCHW map: the in-place sum after the mixer is channels-last in the block itself
        nchw = blk(x.contiguous(), rope)
        assert ((nchw - plain).abs().max() / plain.abs().max()).item() < 1e-12
        assert calls == [(1, 16, 6, 7)] * 2
    assert_inference_only(blk, lambda: blk(x, rope))  # parameters require grad: refused


def test_mixer_output_is_channels_last_for_one_image():
    """The token mixer's output is viewed as an NCHW map with channels-last strides, batch
    stride included, also for a batch of one (a strided batch dimension made the next conv copy
    the map to NCHW)."""
    net = small_nalaformer()
    blk, rope = net.layers[0].blocks[0], net.layers[0].RoPE((6, 7))
    with torch.no_grad():
        for B in (1, 2):
            a = blk._mix(channels_last(B, 16, 6, 7), rope)
            assert a.stride() == (6 * 7 * 16, 1, 7 * 16, 16)


def test_stem_batchnorm_in_place_equals_module():
    """The stem's inference form (BatchNorm as an in-place affine map, GELU in place) against
    the Sequential it replaces, and the input is left alone."""
    net = small_nalaformer()
    x = channels_last(2, 3, 20, 24)
    x0 = x.clone()
    with torch.no_grad():
        fast = deploy.convert(net.patch_embed)(x)
        assert torch.equal(x, x0)
        assert type(net.patch_embed) is deploy_blocks.ConvStemCPU
        want = net.patch_embed.proj[:1](x)
        for layer in net.patch_embed.proj[1:]:
            want = layer(want)
    assert ((fast - want).abs().max() / want.abs().max()).item() < 1e-12
    bn = torch.nn.BatchNorm2d(3, track_running_stats=False).eval().double()
    y = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    assert torch.allclose(deploy_blocks._bn_inplace_(bn, y.clone()), bn(y))  # batch statistics


def test_mac_count_names_the_convffn_modules():
    """While counting, the blocks run the plain ConvFFN (the kernel bypasses fc1 / dwconv /
    fc2) and the converted block is converted again afterwards."""
    from linattn_mm.flops import count_macs
    net = small_nalaformer().float()
    blk = net.layers[0].blocks[0]
    deploy.convert(blk)
    macs = count_macs(net, torch.randn(1, 3, 64, 64))
    tokens = 16 * 16  # stage 1 after the stride-4 stem
    assert macs.by_module['layers.0.blocks.0.ffn.fc1'] == tokens * 16 * 32
    assert macs.by_module['layers.0.blocks.0.ffn.dwconv'] == tokens * 32 * 9
    assert macs.by_module['layers.0.blocks.0.ffn.fc2'] == tokens * 32 * 16
    assert type(blk) is deploy_blocks.NaLaBlockCPU
    assert type(net.layers[1].blocks[0]) is nf.NaLaBlock
