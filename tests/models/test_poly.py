"""Poly-NL and Poly-SA: both modules against the paper's formulas written out directly (float64),
including a Swin window with a shift (pooling restricted to the regions the Swin mask keeps apart),
a resized p1/p2 grid and PVT spatial reduction; the Poly-NL size of the paper's Table 1; ResNet-50
with Poly-NL equal to a stock ResNet-50 at initialisation and loading its weights; the mmdet ResNet
plugin route; checkpoint resizing of p1/p2; parameter counts next to the paper's."""
import logging

import pytest
import torch
import torch.nn.functional as F
from oracles.shapes import assert_pyramid_outputs
from mmengine.logging import MMLogger
from torch.utils.flop_counter import FlopCounterMode

import linattn_mm  # noqa: F401
from linattn_mm.models.attentions import build_attention
from linattn_mm.models.attentions.poly import PolyNL2d, PolySelfAttention, polynl_cost
from linattn_mm.models.attentions.softmax import shift_window_mask, window_partition
from linattn_mm.models.backbones import LinAttnPVT, LinAttnSwin, LinAttnViT
from linattn_mm.models.backbones.resnet_polynl import PolyNLResNet, valid_mask_from_padding

MMLogger.get_current_instance().setLevel(logging.WARNING)


def randomise_(module, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return module


# ------------------------------------------------------------------------------------------------
# Poly-NL
# ------------------------------------------------------------------------------------------------
def conv1x1(w, b, x):
    """1x1 conv written as a channel matrix product: x (B, C, H, W), w (O, C, 1, 1)."""
    y = torch.einsum('oc,bchw->bohw', w[:, :, 0, 0], x)
    return y + b[None, :, None, None] if b is not None else y


def direct_polynl(m, x, mask=None):
    """Z = alpha X + beta expand(W3(Psi(W1 h ⊙ W2 h) ⊙ h)), h = reduce(X), Psi = mean over the
    valid positions (all when mask is None)."""
    h = conv1x1(m.reduce.weight, m.reduce.bias, x) if m.reduce is not None else x
    a = conv1x1(m.w1.weight, m.w1.bias, h)
    prod = a * conv1x1(m.w2.weight, m.w2.bias, h) if m.order == 3 else a
    B, C, H, W = prod.shape
    psi = torch.zeros(B, C, 1, 1, dtype=x.dtype)
    for b in range(B):
        pos = [(i, j) for i in range(H) for j in range(W) if mask is None or mask[b, i, j]]
        psi[b, :, 0, 0] = sum(prod[b, :, i, j] for i, j in pos) / len(pos)
    y = conv1x1(m.w3.weight, m.w3.bias, psi * h)
    if m.expand is not None:
        y = conv1x1(m.expand.weight, m.expand.bias, y)
    return m.alpha * x + m.beta * y


@pytest.mark.parametrize('reduction,order', [(4, 3), (1, 3), (2, 2)])
def test_polynl_matches_formula_float64(reduction, order):
    m = randomise_(PolyNL2d(8, reduction=reduction, order=order)).double()
    x = torch.randn(2, 8, 5, 7, dtype=torch.float64)
    torch.testing.assert_close(m(x), direct_polynl(m, x), rtol=1e-10, atol=1e-10)


def test_polynl_valid_mask_ignores_padding():
    m = randomise_(PolyNL2d(8, reduction=2)).double()
    x = torch.randn(2, 8, 5, 7, dtype=torch.float64)
    mask = torch.zeros(2, 5, 7, dtype=torch.bool)
    mask[0, :4, :6] = True
    mask[1] = True
    torch.testing.assert_close(m(x, valid_mask=mask), direct_polynl(m, x, mask), rtol=1e-10,
                               atol=1e-10)
    # a zero-padded image with its mask gives the unpadded image's result on the valid region
    img = torch.randn(1, 8, 4, 6, dtype=torch.float64)
    padded = F.pad(img, (0, 3, 0, 2))
    pmask = torch.zeros(1, 6, 9, dtype=torch.bool)
    pmask[:, :4, :6] = True
    torch.testing.assert_close(m(padded, valid_mask=pmask)[..., :4, :6], m(img))
    # ... while without the mask the padding biases the mean
    assert (m(padded)[..., :4, :6] - m(img)).abs().max() > 1e-3
    with pytest.raises(ValueError, match='without valid positions'):
        m(x, valid_mask=torch.zeros(2, 5, 7, dtype=torch.bool))


def test_polynl_is_identity_at_init_and_sizes_of_table1():
    m = PolyNL2d(1024, reduction=4)
    x = torch.randn(1, 1024, 14, 14)
    assert torch.equal(m(x), x)  # alpha = 1, beta = 0
    params = sum(p.numel() for p in m.parameters())
    # 2*1024*256 + 3*256^2 weights + 2048 biases + alpha, beta; paper Table 1: 0.7M
    assert params == 2 * 1024 * 256 + 3 * 256 ** 2 + 2048 + 2 == 722946
    with FlopCounterMode(display=False) as fc:
        m(x)
    macs = fc.get_total_flops() / 2
    assert macs == polynl_cost(1024, 196) == 196 * (2 * 1024 * 256 + 3 * 256 ** 2)
    print(f'PolyNL2d 14x14x1024 r=4: {params / 1e6:.3f}M params (paper 0.7M), '
          f'{macs / 1e9:.3f} GMACs (paper 0.14G)')
    assert abs(macs / 1e9 - 0.14) < 0.005


def test_polynl_errors():
    with pytest.raises(ValueError, match='order'):
        PolyNL2d(8, order=4)
    with pytest.raises(ValueError, match='divisible'):
        PolyNL2d(10, reduction=4)
    with pytest.raises(ValueError, match=r'expected \(B, 8, H, W\)'):
        PolyNL2d(8)(torch.randn(1, 4, 3, 3))


# ------------------------------------------------------------------------------------------------
# ResNet-50 + Poly-NL
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def torchvision_r50(tmp_path_factory):
    torchvision = pytest.importorskip('torchvision')
    torch.manual_seed(0)
    tv = torchvision.models.resnet50()
    # non-trivial BN statistics so that a wrong mapping could not hide
    with torch.no_grad():
        for mod in tv.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.1, 0.1)
                mod.running_var.uniform_(0.5, 1.5)
                mod.weight.uniform_(0.5, 1.0)
    path = tmp_path_factory.mktemp('r50') / 'resnet50_tv.pth'
    torch.save(tv.state_dict(), path)
    return tv.eval(), str(path)


def tv_features(tv, x):
    y = tv.maxpool(tv.relu(tv.bn1(tv.conv1(x))))
    outs = []
    for layer in (tv.layer1, tv.layer2, tv.layer3, tv.layer4):
        y = layer(y)
        outs.append(y)
    return outs


def test_r50_polynl_loads_stock_weights_and_equals_stock_resnet(torchvision_r50, tmp_path):
    tv, path = torchvision_r50
    net = PolyNLResNet(init_cfg=dict(type='Pretrained', checkpoint=path))
    net.init_weights()
    rep = net.pretrained_load_report
    assert sorted(rep.missing) == sorted(k for k in net.state_dict() if k.startswith('polynl_'))
    assert {k.split('.')[0] for k in rep.missing} == {'polynl_layer3_5'}
    assert not rep.unexpected
    assert set(rep.dropped) == {'fc.weight', 'fc.bias'}
    net.eval()
    x = torch.randn(2, 3, 97, 131)
    with torch.no_grad():
        ours, ref = net(x), tv_features(tv, x)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # an mmpretrain classifier file ('state_dict', 'backbone.' / 'head.fc.' keys) loads the same
    sd = {'backbone.' + k: v for k, v in tv.state_dict().items() if not k.startswith('fc.')}
    sd['head.fc.weight'] = tv.fc.weight.detach().clone()
    sd['head.fc.bias'] = tv.fc.bias.detach().clone()
    torch.save({'meta': {}, 'state_dict': sd}, tmp_path / 'mmpretrain_r50.pth')
    net2 = PolyNLResNet(init_cfg=dict(type='Pretrained',
                                      checkpoint=str(tmp_path / 'mmpretrain_r50.pth')))
    net2.init_weights()
    assert {k.split('.')[0] for k in net2.pretrained_load_report.missing} == {'polynl_layer3_5'}
    assert not net2.pretrained_load_report.unexpected
    with torch.no_grad():
        torch.testing.assert_close(net2.eval()(x)[2], ref[2], rtol=0, atol=0)
    # once beta moves away from 0 the block acts (and only from res4 on)
    with torch.no_grad():
        net.polynl_layer3_5.beta.fill_(0.5)
        moved = net(x)
    torch.testing.assert_close(moved[1], ref[1], rtol=0, atol=0)
    assert (moved[2] - ref[2]).abs().max() > 1e-3


def test_r50_polynl_placement_options_and_freezing():
    net = PolyNLResNet(polynl_positions=[(2, -1), (3, 0)], frozen_stages=3,
                       polynl_cfg=dict(reduction=8))
    names = [n for n, _ in net.named_children() if n.startswith('polynl')]
    assert names == ['polynl_layer3_5', 'polynl_layer4_0']
    assert net.polynl_layer4_0.in_channels == 1024  # the input of res5's first block
    assert net.polynl_layer3_5.reduction == 8
    net.train()
    assert not any(p.requires_grad for p in net.polynl_layer3_5.parameters())  # in stage 3
    assert all(p.requires_grad for p in net.polynl_layer4_0.parameters())
    with pytest.raises(ValueError, match='out of range'):
        PolyNLResNet(polynl_positions=[(2, 6)])
    with pytest.raises(ValueError, match='given twice'):
        PolyNLResNet(polynl_positions=[(2, 5), (2, -1)])
    with pytest.raises(KeyError, match='depth'):
        PolyNLResNet(depth=34)


def test_valid_mask_inferred_from_zero_padding():
    img = torch.randn(2, 3, 64, 96)
    img[0, :, 40:] = 0  # image 0 is 40 x 70, zero-padded to 64 x 96
    img[0, :, :, 70:] = 0
    mask = valid_mask_from_padding(img, (4, 6))  # stride-16 grid
    assert mask.shape == (2, 1, 4, 6)
    assert mask[0, 0].sum() == 3 * 5 and mask[0, 0, :3, :5].all()  # ceil(40/16), ceil(70/16)
    assert mask[1].all()


def test_r50_polynl_ignores_padding_of_a_batch():
    """The res4 Poly-NL block sees the same mean with and without extra zero padding around an
    image when the mask is inferred (beta != 0)."""
    net = PolyNLResNet(out_indices=(2, ))
    net.init_weights()
    randomise_(net.polynl_layer3_5, scale=0.05)
    net.eval()
    seen = {}

    def hook(mod, args, kwargs, out):
        x, mask = args[0], kwargs.get('valid_mask')
        h = mod.reduce(x)
        prod = mod.w1(h) * mod.w2(h)
        m = torch.ones_like(prod[:, :1]) if mask is None else mask.to(prod.dtype)
        seen.setdefault('psi', []).append((prod * m).sum((2, 3)) / m.sum((2, 3)))
    net.polynl_layer3_5.register_forward_hook(hook, with_kwargs=True)
    img = torch.randn(1, 3, 128, 160)
    with torch.no_grad():
        net(img)
        net(F.pad(img, (0, 64, 0, 32)))
    # the map inside the valid region differs only near the border (3x3 convs see the padding),
    # so compare with the mask of the unpadded size: same number of averaged positions
    a, b = seen['psi']
    assert a.shape == b.shape
    rel = (a - b).abs().max() / a.abs().max()
    assert rel < 0.25, rel  # border effects only; the padding itself is excluded
    net.pad_mask = None
    with torch.no_grad():
        net(F.pad(img, (0, 64, 0, 32)))
    c = seen['psi'][2]
    assert (c - a).abs().max() / a.abs().max() > rel  # counting the padding biases Psi more


def test_polynl_as_mmdet_resnet_plugin():
    mmdet_registry = pytest.importorskip('mmdet.registry')
    from mmengine.registry import DefaultScope
    with DefaultScope.overwrite_default_scope('mmdet'):
        cfg = dict(type='ResNet', depth=50, out_indices=(0, 1, 2, 3), norm_eval=False)
        plain = mmdet_registry.MODELS.build(cfg)
        plug = mmdet_registry.MODELS.build(dict(cfg, plugins=[dict(
            cfg=dict(type='PolyNL2d', reduction=4), stages=(False, False, True, False),
            position='after_conv3')]))
    blocks = [n for n, m in plug.named_modules() if isinstance(m, PolyNL2d)]
    assert len(blocks) == 6 and blocks[0] == 'layer3.0.polynl_block'  # every res4 block
    missing, unexpected = plug.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all('polynl_block' in k for k in missing)
    plain.eval()
    plug.eval()
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        for a, b in zip(plain(x), plug(x)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Poly-SA
# ------------------------------------------------------------------------------------------------
def sigma_direct(m, s):
    if m.sigma == 'layernorm':
        mu = s.mean(-1, keepdim=True)
        var = ((s - mu) ** 2).mean(-1, keepdim=True)
        return (s - mu) / torch.sqrt(var + m.sigma_norm.eps) * m.sigma_norm.weight + \
            m.sigma_norm.bias
    if m.sigma == 'softmax':
        e = torch.exp(s - s.max(-1, keepdim=True).values)
        return e / e.sum(-1, keepdim=True)
    if m.sigma == 'sigmoid':
        return 1 / (1 + torch.exp(-s))
    return s


def resize_table_direct(table, src_hw, dst_hw, extra, mass):
    """(1, e + grid, h) -> (e + n, h): class rows kept, the grid bicubic-resized (align_corners
    False); with ``mass`` the grid part scaled by src/dst positions."""
    t = table[0]
    if tuple(src_hw) == tuple(dst_hw):
        return t
    g = t[extra:].reshape(*src_hw, -1).permute(2, 0, 1)[None]
    g = F.interpolate(g, size=dst_hw, mode='bicubic', align_corners=False)[0]
    g = g.permute(1, 2, 0).reshape(dst_hw[0] * dst_hw[1], -1)
    if mass:
        g = g * (src_hw[0] * src_hw[1]) / (dst_hw[0] * dst_hw[1])
    return torch.cat([t[:extra], g], 0)


def dwconv_direct(m, y, hw, extra):
    """3x3 depth-wise conv on the grid tokens (zero padding) by explicit shifted sums; class tokens
    through the centre tap and bias (an isolated 1x1 map)."""
    B, N, C = y.shape
    H, W = hw
    g = y[:, extra:].reshape(B, H, W, C)
    padded = torch.zeros(B, H + 2, W + 2, C, dtype=y.dtype)
    padded[:, 1:H + 1, 1:W + 1] = g
    k = m.proj.weight[:, 0]  # (C, 3, 3)
    acc = sum(padded[:, i:i + H, j:j + W] * k[:, i, j] for i in range(3) for j in range(3))
    out = (acc + m.proj.bias).reshape(B, H * W, C)
    if extra:
        out = torch.cat([y[:, :extra] * k[:, 1, 1] + m.proj.bias, out], 1)
    return out


def project_direct(m, y, hw):
    if m.proj_type == 'linear':
        return y @ m.proj.weight.T + m.proj.bias
    return dwconv_direct(m, y, hw, m.num_extra_tokens)


def direct_poly_global(m, x, hw):
    """Y = Q ⊙ p1 sigma(p2^T (K ⊙ V)) per head, token by token."""
    B, N, C = x.shape
    h, d, e = m.num_heads, m.head_dims, m.num_extra_tokens
    if m.sr_ratio > 1:
        q = x @ m.q.weight.T + m.q.bias
        grid = x[:, e:].transpose(1, 2).reshape(B, C, *hw)
        red = F.conv2d(grid, m.sr.weight, m.sr.bias, stride=m.sr_ratio)
        kv_hw = tuple(red.shape[-2:])
        red = F.layer_norm(red.flatten(2).transpose(1, 2), (C, ), m.norm.weight, m.norm.bias,
                           m.norm.eps)
        red = torch.cat([x[:, :e], red], 1)
        kv = red @ m.kv.weight.T + m.kv.bias
        k, v = kv[..., :C], kv[..., C:]
    else:
        qkv = x @ m.qkv.weight.T + m.qkv.bias
        q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
        kv_hw = tuple(hw)
    p1 = resize_table_direct(m.p1, m.q_hw, hw, e, mass=False)
    p2 = resize_table_direct(m.p2, m.kv_hw, kv_hw, e, mass=m.rescale_p2)
    y = torch.zeros(B, N, C, dtype=x.dtype)
    for b in range(B):
        for hd in range(h):
            sl = slice(hd * d, (hd + 1) * d)
            s = sum(p2[n, hd] * k[b, n, sl] * v[b, n, sl] for n in range(k.shape[1]))
            s = sigma_direct(m, s)
            for n in range(N):
                y[b, n, sl] = q[b, n, sl] * p1[n, hd] * s
    return project_direct(m, y, hw)


@pytest.mark.parametrize('sigma', PolySelfAttention.SIGMAS)
@pytest.mark.parametrize('proj', PolySelfAttention.PROJS)
@pytest.mark.parametrize('extra,pre_hw,hw', [(1, (4, 4), (5, 7)), (0, (3, 3), (3, 3)),
                                             (1, (4, 4), (2, 3))])
def test_poly_sa_global_matches_formula_float64(sigma, proj, extra, pre_hw, hw):
    m = randomise_(PolySelfAttention(12, 3, sigma=sigma, proj=proj, pretrain_hw=pre_hw,
                                     num_extra_tokens=extra)).double()
    x = torch.randn(2, extra + hw[0] * hw[1], 12, dtype=torch.float64)
    torch.testing.assert_close(m(x, hw), direct_poly_global(m, x, hw), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize('hw', [(8, 8), (9, 11)])
def test_poly_sa_spatial_reduction_matches_formula_float64(hw):
    m = randomise_(PolySelfAttention(8, 2, sr_ratio=2, pretrain_hw=(6, 6))).double()
    assert m.kv_hw == (3, 3)
    x = torch.randn(2, hw[0] * hw[1], 8, dtype=torch.float64)
    torch.testing.assert_close(m(x, hw), direct_poly_global(m, x, hw), rtol=1e-9, atol=1e-9)
    # CvT-style full-resolution K/V on request
    full = PolySelfAttention(8, 2, sr_ratio=2, spatial_reduction=False)
    assert full.sr_ratio == 1 and not hasattr(full, 'sr')


def direct_poly_windows(m, x, hw):
    """Swin windows, shifted for odd blocks: token i of a window pools over the tokens j of its
    window that the Swin shift mask lets it attend (mask 0) and that are not grid padding."""
    B, N, C = x.shape
    H, W = hw
    ws, s = m.window_size, m.shift_size
    if H <= ws and W <= ws:
        s = 0
    h, d = m.num_heads, m.head_dims
    Hp, Wp = H + (-H) % ws, W + (-W) % ws
    g = torch.zeros(B, Hp, Wp, C, dtype=x.dtype)
    g[:, :H, :W] = x.reshape(B, H, W, C)
    real = torch.zeros(1, Hp, Wp, 1)
    real[:, :H, :W] = 1
    if s:
        g = torch.roll(g, (-s, -s), (1, 2))
        real = torch.roll(real, (-s, -s), (1, 2))
    wins = window_partition(g, ws)  # (B*nW, n, C)
    real = window_partition(real, ws)[..., 0]  # (nW, n)
    nW = real.shape[0]
    mask = shift_window_mask(Hp, Wp, ws, s, x.device) if s else torch.zeros(nW, ws * ws, ws * ws)
    qkv = wins @ m.qkv.weight.T + m.qkv.bias
    q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    p1, p2 = m.p1[0], m.p2[0]
    y = torch.zeros_like(wins)
    for bw in range(wins.shape[0]):
        w = bw % nW
        for i in range(ws * ws):
            if not real[w, i]:
                continue
            js = [j for j in range(ws * ws) if mask[w, i, j] == 0 and real[w, j]]
            for hd in range(h):
                sl = slice(hd * d, (hd + 1) * d)
                pooled = sum(p2[j, hd] * k[bw, j, sl] * v[bw, j, sl] for j in js)
                y[bw, i, sl] = q[bw, i, sl] * p1[i, hd] * sigma_direct(m, pooled)
    out = y.view(B, Hp // ws, Wp // ws, ws, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(B, Hp, Wp, C)
    if s:
        out = torch.roll(out, (s, s), (1, 2))
    out = out[:, :H, :W].reshape(B, H * W, C)
    return project_direct(m, out, hw)


@pytest.mark.parametrize('block_idx', [0, 1])
@pytest.mark.parametrize('hw', [(8, 8), (9, 11), (3, 4)])
@pytest.mark.parametrize('sigma,proj', [('layernorm', 'dwconv'), ('softmax', 'linear')])
def test_poly_sa_windows_with_shift_match_formula_float64(block_idx, hw, sigma, proj):
    m = randomise_(PolySelfAttention(8, 2, window_size=4, block_idx=block_idx, sigma=sigma,
                                     proj=proj)).double()
    assert m.shift_size == 2 * block_idx
    x = torch.randn(2, hw[0] * hw[1], 8, dtype=torch.float64)
    torch.testing.assert_close(m(x, hw), direct_poly_windows(m, x, hw), rtol=1e-9, atol=1e-9)


def test_shifted_windows_keep_regions_apart():
    """Changing a token changes the output only inside its own shift region of its window (before
    the projection mixes neighbours): the shift mask keeps its meaning."""
    m = randomise_(PolySelfAttention(8, 2, window_size=4, block_idx=1, proj='linear')).double()
    hw = (8, 8)
    x = torch.randn(1, 64, 8, dtype=torch.float64)
    base = m(x, hw)
    x2 = x.clone()
    x2[0, 7 * 8 + 7] += 1.0  # bottom-right corner: after the shift it shares a window with
    changed = (m(x2, hw) - base).abs().amax(-1)[0].reshape(8, 8) > 1e-12  # tokens of other regions
    # without pooling across regions only the corner token's own region (the 2x2 bottom-right
    # corner, a separate region of the shifted grid) can change
    assert changed.nonzero().tolist() == [[6, 6], [6, 7], [7, 6], [7, 7]]


def test_poly_sa_options_and_errors():
    with pytest.raises(ValueError, match='sigma'):
        PolySelfAttention(8, 2, sigma='tanh')
    with pytest.raises(ValueError, match='proj'):
        PolySelfAttention(8, 2, proj='conv5')
    with pytest.raises(ValueError, match='window_size'):
        PolySelfAttention(8, 2, window_size=7, num_extra_tokens=1)
    with pytest.raises(TypeError, match='valid options'):
        build_attention(dict(type='PolySelfAttention', sigmaa='softmax'), embed_dims=8,
                        num_heads=2)
    m = PolySelfAttention(8, 2, pretrain_hw=(4, 4))
    # 'mean' init: p2 is a mean over the pretraining grid, p1 ones -> Eq. 16
    assert torch.allclose(m.p2, torch.full_like(m.p2, 1 / 16)) and torch.all(m.p1 == 1)
    t = PolySelfAttention(8, 2, p_init='trunc_normal')
    assert 0.005 < t.p1.std() < 0.05
    with pytest.raises(ValueError, match='expected tokens'):
        m(torch.randn(1, 10, 8), (4, 4))


@pytest.mark.parametrize('rescale_p2', [True, False])
def test_poly_sa_checkpoint_resize_keeps_the_function(tmp_path, rescale_p2):
    """A Poly-DeiT saved at pretraining grid 4x4 loads into a model built for 6x6: p1/p2 are
    resized (p2 keeping its mass when rescale_p2, as the module does for another input size) and
    the model computes what the original computes at 6x6."""
    arch = dict(embed_dims=16, depth=2, num_heads=2)
    kw = dict(arch=arch, patch_size=8,
              attn_cfg=dict(type='PolySelfAttention', rescale_p2=rescale_p2),
              out_type='cls_token', drop_path_rate=0.)
    src = LinAttnViT(pretrain_img_size=32, **kw)
    src.init_weights()
    randomise_(src, scale=0.1)
    torch.save({'model': src.state_dict()}, tmp_path / 'poly_deit.pth')
    dst = LinAttnViT(pretrain_img_size=48, init_cfg=dict(
        type='Pretrained', checkpoint=str(tmp_path / 'poly_deit.pth')), **kw)
    dst.init_weights()
    rep = dst.pretrained_load_report
    assert not rep.missing and not rep.unexpected
    assert {'blocks.0.attn.p1', 'blocks.0.attn.p2', 'pos_embed'} <= set(rep.resized)
    if rescale_p2:
        assert 'scaled by 16/36' in rep.notes.get('blocks.0.attn.p2', '') or \
            'scaled by 16/36' in str(rep.resized.get('blocks.0.attn.p2', ''))
    else:
        assert 'scaled' not in rep.notes.get('blocks.0.attn.p2', '')
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        torch.testing.assert_close(dst.eval()(x)[0], src.eval()(x)[0], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# skeletons and sizes
# ------------------------------------------------------------------------------------------------
def n_params(m):
    return sum(p.numel() for p in m.parameters())


def test_parameter_counts_next_to_the_paper():
    """Paper Table 3: Swin-T 28.3M -> 26.1M with Poly-SA, DeiT-"Small" (the Tiny size) 5.7M ->
    5.4M, counted with the 1000-class head. The 3x3 depth-wise projection replacing the C x C one
    reproduces the drop (spec §1.3)."""
    poly = dict(type='PolySelfAttention')
    swin = LinAttnSwin(arch='t', attn_cfg=dict(poly, window_size=7))
    swin_head = 768 * 1000 + 1000
    swin_m = (n_params(swin) + swin_head) / 1e6
    deit = LinAttnViT(arch='t', attn_cfg=poly, out_type='cls_token')
    deit_m = (n_params(deit) + 192 * 1000 + 1000) / 1e6
    print(f'Poly-Swin-T {swin_m:.2f}M (paper 26.1M), Poly-DeiT-T {deit_m:.2f}M (paper 5.4M)')
    assert abs(swin_m - 26.1) / 26.1 < 0.01
    assert abs(deit_m - 5.4) / 5.4 < 0.03
    assert round(swin_m, 3) == 26.164 and round(deit_m, 3) == 5.312  # pinned


@pytest.mark.parametrize('build,channels', [
    (lambda: LinAttnSwin(arch='t', attn_cfg=dict(type='PolySelfAttention', window_size=7)),
     [96, 192, 384, 768]),
    (lambda: LinAttnPVT(arch='t', attn_cfg=dict(type='PolySelfAttention')), [64, 128, 320, 512]),
], ids=['swin', 'pvt'])
@pytest.mark.parametrize('size', [(33, 47), (200, 334)])
def test_skeleton_output_shapes_at_odd_sizes(build, channels, size):
    model = build()
    model.init_weights()
    assert_pyramid_outputs(model, size, channels)


def test_deit_and_resnet_outputs_at_odd_sizes():
    deit = LinAttnViT(arch='t', attn_cfg=dict(type='PolySelfAttention'))
    deit.init_weights()
    assert_pyramid_outputs(deit, (65, 97), [192] * 4, plain_vit=True)
    net = PolyNLResNet().eval()
    net.init_weights()
    with torch.no_grad():
        outs = net(torch.randn(1, 3, 65, 97))
    assert [tuple(o.shape[1:]) for o in outs] == [(256, 17, 25), (512, 9, 13), (1024, 5, 7),
                                                 (2048, 3, 4)]


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_autocast_large_inputs(dtype):
    m = randomise_(PolySelfAttention(32, 4, pretrain_hw=(8, 8)), scale=0.2)
    x = torch.randn(1, 40 * 40, 32) * 100
    ref = m(x, (40, 40))
    with torch.autocast('cpu', dtype=dtype):
        out = m(x, (40, 40))
        y = PolyNL2d(32)(x.transpose(1, 2).reshape(1, 32, 40, 40))
    assert torch.isfinite(out).all() and torch.isfinite(y).all()
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < (0.05 if dtype == torch.bfloat16 else 0.01), rel


def test_torchvision_shorthand_resolves_without_download():
    from linattn_mm.checkpoint import CheckpointError, resolve_model_url
    assert resolve_model_url('torchvision://resnet50') == \
        'https://download.pytorch.org/models/resnet50-0676ba61.pth'
    assert resolve_model_url('checkpoints/x.pth') == 'checkpoints/x.pth'
    with pytest.raises(CheckpointError, match="unknown torchvision model 'resnet51'"):
        resolve_model_url('torchvision://resnet51')
