"""PolaFormer: the polarity-aware attention against the formulas written out directly, official
checkpoint layouts loading into the backbones and the classifiers, parameter counts of the official
models, odd input sizes, position-encoding resizing and mixed precision."""
import argparse
import math

import pytest
import torch
from oracles.shapes import assert_pyramid_outputs
import torch.nn.functional as F

import linattn_mm
from linattn_mm.models.attentions import build_attention
from linattn_mm import deploy
from linattn_mm.models.attentions.pola import PolaLinearAttention
from linattn_mm.ops.pola import polarity_attention_reference as polarity_attention
from oracles.pola import polarity_attention_one_gemm
from linattn_mm.models.backbones import LinAttnPVT, LinAttnPVTv2, LinAttnSwin, LinAttnViT

POLA_PVT = dict(type='PolaLinearAttention')
POLA_L = dict(type='PolaLinearAttention', qkv_layout='qkvg')
SWIN_LLSS = [POLA_L, POLA_L, dict(type='WindowSoftmaxAttention', window_size=7),
             dict(type='WindowSoftmaxAttention', window_size=7)]
SWIN_LLSS_CLS = SWIN_LLSS[:3] + [dict(type='WindowSoftmaxAttention', window_size=7, shift=False)]


def randomise_(module, seed=0):
    """Give every parameter of a Pola mixer non-trivial values (power/scale/PE are zero at init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == 'scale':
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
            elif name == 'power':
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


# ------------------------------------------------------------------------------------------------
# the attention against the formulas
# ------------------------------------------------------------------------------------------------
def direct_pola(m, x, hw):
    """PolaFormer attention written out from the formulas, float64, with the four polarity terms
    <phi(q+),phi(k+)>, <phi(q-),phi(k-)> (same-signed) and <phi(q+),phi(k-)>, <phi(q-),phi(k+)>
    (opposite-signed) as explicit N x n matrices. Independent of the module's code paths."""
    B, N, C = x.shape
    H, W = hw
    h = m.num_heads
    d = C // h
    e = m.num_extra_tokens
    # projections (official chunk orders; without the dynamic gate no g rows)
    g = None
    if m.qkv_layout == 'qkvg':
        lin = m.qkvg if m.gate_type == 'dynamic' else m.qkv
        out4 = x @ lin.weight.T + lin.bias
        q, k, v = out4[..., :C], out4[..., C:2 * C], out4[..., 2 * C:3 * C]
        if m.gate_type == 'dynamic':
            g = out4[..., 3 * C:]
        kv_grid = (H, W)
    else:
        lin = m.qg if m.gate_type == 'dynamic' else m.q
        qg = x @ lin.weight.T + lin.bias
        q = qg[..., :C]
        if m.gate_type == 'dynamic':
            g = qg[..., C:]
        src, kv_grid = x, (H, W)
        r = m.la_sr_ratio
        if r > 1:
            grid = x[:, e:].transpose(1, 2).reshape(B, C, H, W)
            grid = F.conv2d(grid, m.sr.weight, m.sr.bias, stride=r)
            kv_grid = tuple(grid.shape[-2:])
            grid = F.layer_norm(grid.flatten(2).transpose(1, 2), (C, ), m.norm.weight,
                                m.norm.bias, m.norm.eps)
            src = torch.cat([x[:, :e], grid], 1)
        kv = src @ m.kv.weight.T + m.kv.bias
        k, v = kv[..., :C], kv[..., C:]
    n = k.shape[1]
    # position encoding on the keys (grid tokens only), bicubic resize of the pretraining table
    pe = m.positional_encoding.reshape(1, *m.pos_enc_hw, C).permute(0, 3, 1, 2)
    pe = F.interpolate(pe, size=kv_grid, mode='bicubic', align_corners=False)
    pe = pe.flatten(2).transpose(1, 2)
    k = k + torch.cat([torch.zeros(1, e, C, dtype=x.dtype), pe], 1)
    # temperature and exponents
    s = torch.log1p(torch.exp(m.scale))  # softplus
    q, k = q / s, k / s
    p = 1 + m.alpha / (1 + torch.exp(-m.power))  # (1, h, 1, d)
    out = torch.zeros(B, N, C, dtype=x.dtype)
    for b in range(B):
        for i in range(h):
            sl = slice(i * d, (i + 1) * d)
            ph = p[0, i, 0]
            qp, qn = q[b, :, sl].clamp(min=0) ** ph, (-q[b, :, sl]).clamp(min=0) ** ph
            kp, kn = k[b, :, sl].clamp(min=0) ** ph, (-k[b, :, sl]).clamp(min=0) ** ph
            same = qp @ kp.T + qn @ kn.T  # (N, n): the two same-signed terms
            opp = qp @ kn.T + qn @ kp.T  # (N, n): the two opposite-signed terms
            vh = v[b, :, sl]
            half = (d + 1) // 2
            vs, vo = vh[:, :half], vh[:, half:]
            eps = m.eps
            xs = (same @ vs / n) / (same.sum(1, keepdim=True) / n + eps)
            xo = (opp @ vo / n) / (opp.sum(1, keepdim=True) / n + eps)
            out[b, :, sl] = torch.cat([xs, xo], 1)
    # depth-wise conv on V (grid only), one kernel shared by the heads = a per-channel conv whose
    # weight is the shared kernel tiled over the heads; none without it (use_dwc=False)
    if m.use_dwc:
        vg = v[:, e:].transpose(1, 2)  # (B, C, n_grid)
        if vg.shape[-1] != H * W:
            vg = F.interpolate(vg, size=H * W, mode='linear', align_corners=False)
        conv = F.conv2d(vg.reshape(B, C, H, W), m.dwc.weight.repeat(h, 1, 1, 1),
                        m.dwc.bias.repeat(h), padding=m.kernel_size // 2, groups=C)
        out[:, e:] = out[:, e:] + conv.flatten(2).transpose(1, 2)
    if g is not None:
        out = out * g
    elif m.gate_type == 'static':
        out = out * m.gate
    return out @ m.proj.weight.T + m.proj.bias


#: (qkv layout, class tokens, la_sr_ratio, grid) of the tests against the formulas written out
LAYOUT_CASES = [
    ('qg_kv', 0, 1, (5, 7)),
    ('qg_kv', 1, 1, (5, 7)),
    ('qg_kv', 0, 2, (6, 7)),
    ('qkvg', 0, 1, (5, 7)),
    ('qkvg', 1, 1, (4, 6)),
]


@pytest.mark.parametrize('layout,extra,sr,hw', LAYOUT_CASES)
@pytest.mark.parametrize('core', ['reference', 'fast'])
def test_attention_matches_direct_formulas(layout, extra, sr, hw, core):
    torch.manual_seed(0)
    m = PolaLinearAttention(24, 3, qkv_layout=layout, la_sr_ratio=sr, pretrain_hw=(4, 4),
                            num_extra_tokens=extra, core=core)
    randomise_(m).double().eval()
    x = torch.randn(2, extra + hw[0] * hw[1], 24, dtype=torch.float64)
    got = m(x, hw)
    want = direct_pola(m, x, hw)
    assert got.dtype == torch.float64
    assert (got - want).abs().max().item() < 1e-6 * max(1., want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('layout,extra,sr,hw', LAYOUT_CASES)
@pytest.mark.parametrize('gate', ['none', 'dynamic'])
@pytest.mark.parametrize('core', ['reference', 'fast'])
def test_without_dwc_matches_direct_formulas(layout, extra, sr, hw, gate, core):
    """``use_dwc=False``: the polarity streams without the conv term; with ``gate='none'`` the
    paper's "polarity only" ablation, ``proj([x_s, x_o])``."""
    torch.manual_seed(0)
    m = PolaLinearAttention(24, 3, qkv_layout=layout, la_sr_ratio=sr, pretrain_hw=(4, 4),
                            num_extra_tokens=extra, core=core, gate=gate, use_dwc=False)
    assert not hasattr(m, 'dwc') and m.conv_term(torch.zeros(1, 35, 24), (5, 7)) is None
    randomise_(m).double().eval()
    x = torch.randn(2, extra + hw[0] * hw[1], 24, dtype=torch.float64)
    got = m(x, hw)
    want = direct_pola(m, x, hw)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # the conv term is really gone: a module with it differs by DWC(v) (times g)
    with_dwc = PolaLinearAttention(24, 3, qkv_layout=layout, la_sr_ratio=sr, pretrain_hw=(4, 4),
                                   num_extra_tokens=extra, core=core, gate=gate).double().eval()
    missing, unexpected = with_dwc.load_state_dict(m.state_dict(), strict=False)
    assert sorted(missing) == ['dwc.bias', 'dwc.weight'] and not unexpected
    with torch.no_grad():
        with_dwc.dwc.weight.normal_()
        assert (with_dwc(x, hw) - got)[:, extra:].abs().max() > 1e-3


#: Pola-DeiT-T backbone (class-token output, no head) with gate='none', use_dwc=False, no per-block
#: PE: counted here
POLARITY_ONLY_DEIT_T = 5_529_024


def test_polarity_only_parameters_and_keys():
    """Parameter counts pinned: C = 64, h = 2 (d = 32), 7x7 pretraining grid, qg_kv layout."""
    def count(**kw):
        return sum(p.numel() for p in PolaLinearAttention(64, 2, pretrain_hw=(7, 7),
                                                          **kw).parameters())
    # q 64*64+64, kv 64*128+128, proj 64*64+64, power 2*32, scale 64, PE 49*64
    assert count(gate='none', use_dwc=False) == 4160 + 8320 + 4160 + 64 + 64 + 3136 == 19904
    assert count(gate='none') == 19904 + 32 * 25 + 32 == 20736  # + dwc (32, 1, 5, 5) + bias
    assert count() == 20736 + 64 * 64 + 64 == 24896  # official: qg = Linear(C, 2C)
    assert count(use_dwc=False) == 24896 - 832
    m = PolaLinearAttention(64, 2, pretrain_hw=(7, 7), gate='none', use_dwc=False)
    assert set(m.state_dict()) == {'q.weight', 'q.bias', 'kv.weight', 'kv.bias', 'proj.weight',
                                   'proj.bias', 'power', 'scale', 'positional_encoding'}
    assert 'use_dwc=False' in repr(m)
    m.init_weights()  # no dwc to reset
    # Pola-DeiT-T as in the paper's ablation row "polarity only" (Table 3, 68.1): no G, no DWC
    net = LinAttnViT(arch='t', out_type='cls_token',
                     attn_cfg=dict(POLA_L, use_pos_enc=False, gate='none', use_dwc=False))
    n = sum(p.numel() for p in net.parameters())
    full = LinAttnViT(arch='t', out_type='cls_token', attn_cfg=dict(POLA_L, use_pos_enc=False))
    # 12 blocks of C = 192, d = 64: no g rows (192*192 + 192) and no dwc (64*25 + 64)
    assert sum(p.numel() for p in full.parameters()) - n == 12 * (37056 + 1664)
    assert n == POLARITY_ONLY_DEIT_T
    with pytest.raises(TypeError, match='use_dwc must be True or False'):
        PolaLinearAttention(8, 1, pretrain_hw=(2, 2), use_dwc='no')


def test_one_gemm_identity_matches_reference_core():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (11, 13, 13))
    p = 1 + 4 * torch.rand(1, 3, 1, 8, dtype=torch.float64)
    ref = polarity_attention(q, k, v, p)
    torch.testing.assert_close(polarity_attention_one_gemm(q, k, v, p), ref, rtol=1e-12,
                               atol=1e-12)


def test_class_token_not_in_dwc_nor_position_encoding():
    torch.manual_seed(0)
    m = randomise_(PolaLinearAttention(16, 2, qkv_layout='qkvg', pretrain_hw=(3, 3),
                                       num_extra_tokens=1)).eval()
    x = torch.randn(1, 1 + 9, 16)
    a = m(x, (3, 3))
    with torch.no_grad():
        m.dwc.weight.add_(1.)
        m.dwc.bias.add_(1.)
    b = m(x, (3, 3))
    torch.testing.assert_close(a[:, 0], b[:, 0])  # class token: no DWC term
    assert (a[:, 1:] - b[:, 1:]).abs().max() > 1e-3  # grid tokens: DWC term


def test_official_init_and_options():
    m = build_attention(POLA_PVT, embed_dims=64, num_heads=2, pretrain_hw=(56, 56), sr_ratio=8,
                        qkv_bias=True, proj_drop=0., block_idx=0, stage_idx=0)
    m.init_weights()
    sd = m.state_dict()
    assert set(sd) == {'qg.weight', 'qg.bias', 'kv.weight', 'kv.bias', 'proj.weight', 'proj.bias',
                       'dwc.weight', 'dwc.bias', 'power', 'scale', 'positional_encoding'}
    assert sd['qg.weight'].shape == (128, 64) and sd['dwc.weight'].shape == (32, 1, 5, 5)
    assert sd['power'].shape == (1, 2, 1, 32) and sd['scale'].shape == (1, 1, 64)
    assert sd['positional_encoding'].shape == (1, 3136, 64)
    assert m.la_sr_ratio == 1  # the PVT arch's softmax sr_ratio is not taken
    torch.testing.assert_close(m.exponent(), torch.full((1, 2, 1, 32), 3.))
    assert float(F.softplus(m.scale).mean()) == pytest.approx(math.log(2))
    sw = build_attention(POLA_L, embed_dims=96, num_heads=3, pretrain_hw=(56, 56))
    assert sw.qkvg.weight.shape == (384, 96)
    red = PolaLinearAttention(64, 1, la_sr_ratio=8, pretrain_hw=(56, 56))
    assert red.positional_encoding.shape == (1, 49, 64) and red.sr.weight.shape == (64, 64, 8, 8)
    paper = PolaLinearAttention(32, 2, qkv_layout='qkvg', gate='static', temperature=False,
                                use_pos_enc=False)
    assert set(paper.state_dict()) == {'qkv.weight', 'qkv.bias', 'proj.weight', 'proj.bias',
                                       'dwc.weight', 'dwc.bias', 'power', 'gate'}
    assert paper(torch.randn(1, 12, 32), (3, 4)).shape == (1, 12, 32)
    nog = PolaLinearAttention(32, 2, gate='none', use_pos_enc=False)
    assert 'q.weight' in nog.state_dict() and nog(torch.randn(1, 6, 32), (2, 3)).shape == (1, 6, 32)
    with pytest.raises(TypeError, match='sr_ratio'):
        build_attention(dict(type='PolaLinearAttention', sr_ratio=2), embed_dims=8, num_heads=1)
    with pytest.raises(ValueError, match='pretrain_hw'):
        PolaLinearAttention(8, 1)
    with pytest.raises(ValueError, match='qkv_layout'):
        PolaLinearAttention(8, 1, qkv_layout='qkv', pretrain_hw=(2, 2))


# ------------------------------------------------------------------------------------------------
# position encoding resize
# ------------------------------------------------------------------------------------------------
def test_positional_encoding_resized_and_cached():
    torch.manual_seed(0)
    m = randomise_(PolaLinearAttention(16, 2, pretrain_hw=(8, 8)))
    pe = m.positional_encoding.detach().clone()
    want = F.interpolate(pe.reshape(1, 8, 8, 16).permute(0, 3, 1, 2), size=(5, 11),
                         mode='bicubic', align_corners=False).flatten(2).transpose(1, 2)
    torch.testing.assert_close(m.pos_enc((5, 11)), want)
    assert m.pos_enc((8, 8)) is m.positional_encoding
    # the inference form keeps the resized table between calls
    deploy.convert(m.eval())
    x = torch.randn(1, 55, 16)
    with torch.no_grad():
        m(x, (5, 11))
        a = m._inference_cache['pos_enc'][2]
        torch.testing.assert_close(a, want.reshape(55, 16))
        m(x, (5, 11))
        assert m._inference_cache['pos_enc'][2] is a  # cached in inference
        m.positional_encoding.mul_(2)  # in-place update invalidates the cache
        m(x, (5, 11))
        b = m._inference_cache['pos_enc'][2]
        torch.testing.assert_close(b, 2 * want.reshape(55, 16))
        # so does a write through .data (an EMA swap's), which no version counter sees
        m.positional_encoding.data.copy_(3 * pe)
        m(x, (5, 11))
        c = m._inference_cache['pos_enc'][2]
    torch.testing.assert_close(c, 3 * want.reshape(55, 16))
    deploy.revert(m)
    assert '_inference_cache' not in m.__dict__
    # on a 200x334 grid (stage 1 of a 1333x800 image) the module runs and the PE is resized
    big = PolaLinearAttention(32, 1, qkv_layout='qkvg', pretrain_hw=(56, 56)).eval()
    with torch.no_grad():
        y = big(torch.randn(1, 200 * 334, 32), (200, 334))
    assert y.shape == (1, 200 * 334, 32) and torch.isfinite(y).all()
    assert big.pos_enc((200, 334)).shape == (1, 200 * 334, 32)


def test_positional_encoding_resized_when_loading_another_pretrain_size(tmp_path):
    arch = dict(embed_dims=16, depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 4])
    src = LinAttnSwin(arch=arch, attn_cfg=SWIN_LLSS)
    randomise_(src.layers[0].blocks[0].attn)
    torch.save({'model': src.state_dict()}, tmp_path / 'w.pth')
    m = LinAttnSwin(arch=arch, attn_cfg=SWIN_LLSS, pretrain_img_size=384,
                    init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'w.pth')))
    m.init_weights()
    key = 'layers.0.blocks.0.attn.positional_encoding'
    pe = src.state_dict()[key]
    assert m.state_dict()[key].shape == (1, 96 * 96, 16)
    want = F.interpolate(pe.reshape(1, 56, 56, 16).permute(0, 3, 1, 2), size=(96, 96),
                         mode='bicubic', align_corners=False).flatten(2).transpose(1, 2)
    torch.testing.assert_close(m.state_dict()[key], want)
    assert key in m.pretrained_load_report.resized


# ------------------------------------------------------------------------------------------------
# official checkpoints
# ------------------------------------------------------------------------------------------------
def _ln(prefix, c):
    return {f'{prefix}.weight': (c, ), f'{prefix}.bias': (c, )}


def _lin(prefix, cout, cin, bias=True):
    out = {f'{prefix}.weight': (cout, cin)}
    if bias:
        out[f'{prefix}.bias'] = (cout, )
    return out


def _pola_attn_keys(prefix, c, heads, tokens, layout):
    d = c // heads
    keys = {f'{prefix}.power': (1, heads, 1, d), f'{prefix}.scale': (1, 1, c),
            f'{prefix}.positional_encoding': (1, tokens, c),
            f'{prefix}.dwc.weight': (d, 1, 5, 5), f'{prefix}.dwc.bias': (d, )}
    if layout == 'qkvg':
        keys.update(_lin(f'{prefix}.qkvg', 4 * c, c))
    else:
        keys.update(_lin(f'{prefix}.qg', 2 * c, c))
        keys.update(_lin(f'{prefix}.kv', 2 * c, c))
    keys.update(_lin(f'{prefix}.proj', c, c))
    return keys


def official_pola_pvt_shapes(depths, num_classes=1000):
    """Key -> shape of an official pola_pvt_* state dict (spec §4)."""
    dims, heads, mlp = (64, 128, 320, 512), (1, 2, 5, 8), (8, 8, 4, 4)
    shapes, cin, side = {}, 3, 56
    for i in range(4):
        c, k = dims[i], 4 if i == 0 else 2
        shapes[f'pos_embed{i + 1}'] = (1, side * side, c)
        shapes[f'patch_embed{i + 1}.proj.weight'] = (c, cin, k, k)
        shapes[f'patch_embed{i + 1}.proj.bias'] = (c, )
        shapes.update(_ln(f'patch_embed{i + 1}.norm', c))
        for j in range(depths[i]):
            b = f'block{i + 1}.{j}'
            shapes.update(_ln(f'{b}.norm1', c))
            shapes.update(_pola_attn_keys(f'{b}.attn', c, heads[i], side * side, 'qg_kv'))
            shapes.update(_ln(f'{b}.norm2', c))
            shapes.update(_lin(f'{b}.mlp.fc1', c * mlp[i], c))
            shapes.update(_lin(f'{b}.mlp.fc2', c, c * mlp[i]))
        cin, side = c, side // 2
    shapes.update(_ln('norm', 512))
    shapes.update(_lin('head', num_classes, 512))
    return shapes


def official_pola_swin_shapes(embed=96, depths=(2, 2, 6, 2), heads=(3, 6, 12, 24),
                              num_classes=1000):
    """Key -> shape of an official PolaSwinTransformer (attn LLSS, window 56) state dict, with the
    relative_position_index / attn_mask buffers of the softmax stages (spec §4)."""
    shapes = {'patch_embed.proj.weight': (embed, 3, 4, 4), 'patch_embed.proj.bias': (embed, )}
    shapes.update(_ln('patch_embed.norm', embed))
    side = 56
    for i in range(4):
        c = embed * 2 ** i
        for j in range(depths[i]):
            b = f'layers.{i}.blocks.{j}'
            shapes.update(_ln(f'{b}.norm1', c))
            if i < 2:
                shapes.update(_pola_attn_keys(f'{b}.attn', c, heads[i], side * side, 'qkvg'))
            else:
                shapes.update(_lin(f'{b}.attn.qkv', 3 * c, c))
                shapes.update(_lin(f'{b}.attn.proj', c, c))
                shapes[f'{b}.attn.relative_position_bias_table'] = (169, heads[i])
                shapes[f'{b}.attn.relative_position_index'] = (49, 49)
                if j % 2 == 1 and side > 7:
                    shapes[f'{b}.attn_mask'] = ((side // 7) ** 2, 49, 49)
            shapes.update(_ln(f'{b}.norm2', c))
            shapes.update(_lin(f'{b}.mlp.fc1', 4 * c, c))
            shapes.update(_lin(f'{b}.mlp.fc2', c, 4 * c))
        if i < 3:
            shapes[f'layers.{i}.downsample.reduction.weight'] = (2 * c, 4 * c)
            shapes.update(_ln(f'layers.{i}.downsample.norm', 4 * c))
        side //= 2
    shapes.update(_ln('norm', embed * 8))
    shapes.update(_lin('head', num_classes, embed * 8))
    return shapes


def official_file(path, shapes, config, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, s in shapes.items():
        if k.endswith('relative_position_index'):
            sd[k] = torch.randint(0, 169, s, generator=g)
        elif k.endswith('.power'):
            sd[k] = torch.randn(s, generator=g)
        else:
            sd[k] = torch.randn(s, generator=g) * 0.05
    torch.save({'model': sd, 'optimizer': {}, 'lr_scheduler': {}, 'max_accuracy': 82.6,
                'epoch': 299, 'config': config}, path)
    return sd


def swin_config_entry():
    return {'MODEL': {'TYPE': 'pola_swin', 'NAME': 'pola_swin_t', 'SWIN': {'WINDOW_SIZE': 56},
                      'LA': {'ALPHA': 4, 'KERNEL_SIZE': 5, 'ATTN_TYPE': 'LLSS'}}}


def test_official_swin_keys_match_the_spec_count():
    assert len(official_pola_swin_shapes()) == 200  # spec §4: Pola-Swin-T has 200 keys


def test_official_pola_swin_file_into_detection_backbone(tmp_path):
    sd = official_file(tmp_path / 'pola_swin_t.pth', official_pola_swin_shapes(),
                       swin_config_entry())
    m = LinAttnSwin(arch='t', attn_cfg=SWIN_LLSS,
                    init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'pola_swin_t.pth')))
    m.init_weights()
    rep = m.pretrained_load_report
    assert not rep.unexpected
    assert set(rep.missing) == {f'norm{i}.{p}' for i in range(3) for p in ('weight', 'bias')}
    assert set(rep.dropped) == {k for k in sd if k.startswith('head.') or
                                k.endswith(('relative_position_index', 'attn_mask'))}
    assert not rep.resized and len(rep.loaded) == len(m.state_dict()) - 6
    got = m.state_dict()
    for k in ('layers.0.blocks.1.attn.qkvg.weight', 'layers.1.blocks.0.attn.positional_encoding',
              'layers.1.blocks.1.attn.dwc.weight', 'layers.0.blocks.0.attn.power',
              'layers.2.blocks.3.attn.relative_position_bias_table'):
        torch.testing.assert_close(got[k], sd[k])
    torch.testing.assert_close(got['norm3.weight'], sd['norm.weight'])


def test_official_pola_pvt_file_into_detection_backbone(tmp_path):
    cfg = argparse.Namespace(model='pola_pvt_tiny', alpha=4, kernel_size=5, la_sr_ratios='1111')
    sd = official_file(tmp_path / 'pola_pvt_t.pth', official_pola_pvt_shapes([2, 2, 2, 2]), cfg)
    m = LinAttnPVT(arch='t', attn_cfg=POLA_PVT,
                   init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'pola_pvt_t.pth')))
    m.init_weights()
    rep = m.pretrained_load_report
    assert not rep.missing and not rep.unexpected and not rep.resized
    assert set(rep.dropped) == {'norm.weight', 'norm.bias', 'head.weight', 'head.bias'}
    assert len(rep.loaded) == len(m.state_dict()) == len(sd) - 4
    got = m.state_dict()
    for k in ('block1.0.attn.qg.weight', 'block3.1.attn.kv.bias', 'block4.1.attn.scale',
              'block2.0.attn.positional_encoding', 'pos_embed3'):
        torch.testing.assert_close(got[k], sd[k])


def official_pvt_stage_maps(model, x):
    """Stage maps of PVT v1 / PVTv2 in the official ``forward_features`` order (PVT
    ``classification/pvt.py`` and ``pvt_v2.py``; FLatten's and PolaFormer's PVT files inherit
    it), float64, Pola mixers through :func:`direct_pola`: per stage the patch-embedding conv,
    *its own* ``nn.LayerNorm(C)`` (PyTorch's eps 1e-5; the blocks' norms take 1e-6), v1's
    ``pos_embed`` resized bilinearly to the grid, the blocks ``x + attn(LN(x))``, ``x +
    fc2(GELU([dwconv](fc1(LN(x)))))``, PVTv2's stage LayerNorm (1e-6)."""
    v2 = not model.absolute_pos_embed
    outs = []
    for i in range(model.num_stages):
        pe = getattr(model, f'patch_embed{i + 1}')
        _, stride, pad = model.patch_geometry(i)
        x = F.conv2d(x, pe.proj.weight, pe.proj.bias, stride=stride, padding=pad)
        B, C, H, W = x.shape
        t = F.layer_norm(x.flatten(2).transpose(1, 2), (C, ), pe.norm.weight, pe.norm.bias, 1e-5)
        if not v2:
            side = model.pretrain_img_size // model.strides[i]
            pos = getattr(model, f'pos_embed{i + 1}').reshape(1, side, side, C)
            pos = F.interpolate(pos.permute(0, 3, 1, 2), size=(H, W), mode='bilinear')
            t = t + pos.reshape(1, C, H * W).permute(0, 2, 1)
        for blk in getattr(model, f'block{i + 1}'):
            a = F.layer_norm(t, (C, ), blk.norm1.weight, blk.norm1.bias, 1e-6)
            t = t + direct_pola(blk.attn, a, (H, W))
            mlp = blk.mlp
            h = F.layer_norm(t, (C, ), blk.norm2.weight, blk.norm2.bias, 1e-6)
            h = h @ mlp.fc1.weight.T + mlp.fc1.bias
            if v2:
                hc = h.transpose(1, 2).reshape(B, -1, H, W)
                hc = F.conv2d(hc, mlp.dwconv.dwconv.weight, mlp.dwconv.dwconv.bias, padding=1,
                              groups=hc.shape[1])
                h = hc.flatten(2).transpose(1, 2)
            t = t + F.gelu(h) @ mlp.fc2.weight.T + mlp.fc2.bias
        if v2:
            norm = getattr(model, f'norm{i + 1}')
            t = F.layer_norm(t, (C, ), norm.weight, norm.bias, 1e-6)
        x = t.transpose(1, 2).reshape(B, C, H, W)
        outs.append(x)
    return outs


@pytest.mark.parametrize('cls,la_sr', [(LinAttnPVT, 1), (LinAttnPVT, 2), (LinAttnPVTv2, 1)])
def test_pvt_skeleton_matches_official_forward(cls, la_sr):
    """The whole Pola-PVT / PVTv2 forward (patch embeddings, position tables at another size,
    blocks, stage norms) against the official order of operations, float64."""
    arch = dict(embed_dims=[8, 16, 24, 32], depths=[1, 2, 1, 1], num_heads=[1, 2, 3, 4],
                mlp_ratios=[2, 2, 2, 2], sr_ratios=[8, 4, 2, 1])
    torch.manual_seed(0)
    model = cls(arch, pretrain_img_size=64, drop_path_rate=0.,
                attn_cfg=dict(type='PolaLinearAttention', la_sr_ratio=la_sr)).double().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1. if name.endswith(('scale', 'power')) else 0.3
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
            if 'norm' in name and name.endswith('weight'):
                p.add_(1)
    x = torch.randn(2, 3, 96, 64, generator=g, dtype=torch.float64) * 0.5
    with torch.no_grad():
        got = model(x)
        want = official_pvt_stage_maps(model, x)
    assert [o.shape for o in got] == [w.shape for w in want]
    for o, w in zip(got, want):
        torch.testing.assert_close(o, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('name,shapes,config,feat', [
    ('pola-pvt-t_in1k', lambda: official_pola_pvt_shapes([2, 2, 2, 2]),
     lambda: argparse.Namespace(model='pola_pvt_tiny'), 'mean_no_norm'),
    ('pola-swin-t_in1k', official_pola_swin_shapes, swin_config_entry, 'norm_mean'),
])
def test_official_file_into_classifier_gives_official_logits(tmp_path, name, shapes, config, feat):
    path = tmp_path / 'official.pth'
    sd = official_file(path, shapes(), config(), seed=3)
    model = linattn_mm.get_model(name, pretrained=str(path))
    rep = model.load_report
    assert not rep.missing and not rep.unexpected
    assert {'head.weight', 'head.bias'} <= set(rep.loaded)
    expected_dropped = {k for k in sd if k.endswith(('relative_position_index', 'attn_mask'))}
    if feat == 'mean_no_norm':
        expected_dropped |= {'norm.weight', 'norm.bias'}  # unused by the official PVT classifier
    assert set(rep.dropped) == expected_dropped
    # the official forward from the last block's tokens: Swin = final 'norm' -> mean -> head;
    # PVT = mean (its final norm is unused) -> head
    last_block = (model.backbone.layers[3].blocks[-1] if feat == 'norm_mean'
                  else model.backbone.block4[-1])
    seen = []
    hook = last_block.register_forward_hook(lambda mod, args, out: seen.append(out))
    torch.manual_seed(0)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        logits = model(x, mode='tensor')
    hook.remove()
    tokens = seen[-1]  # (B, 49, C)
    if feat == 'norm_mean':
        tokens = F.layer_norm(tokens, tokens.shape[-1:], sd['norm.weight'], sd['norm.bias'])
    direct = F.linear(tokens.mean(1), sd['head.weight'], sd['head.bias'])
    assert logits.shape == (2, 1000)
    torch.testing.assert_close(logits, direct, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# parameter counts of the official models (with the 1000-class head)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('kind,arch,official', [
    ('pvt', 't', 12.92e6), ('pvt', 's', 23.16e6),
    ('swin', 't', 29.29e6), ('swin', 's', 50.60e6), ('swin', 'b', 89.14e6),
])
def test_param_counts_match_official(kind, arch, official):
    with torch.device('meta'):
        if kind == 'pvt':
            m = LinAttnPVT(arch=arch, attn_cfg=POLA_PVT, out_indices=(3, ))
            # official: + unused final norm (2*512) + head
            extra = 2 * 512 + 512 * 1000 + 1000
        else:
            m = LinAttnSwin(arch=arch, attn_cfg=SWIN_LLSS_CLS, out_indices=(3, ))
            c = m.num_features[-1]  # the final norm is the model's norm3
            extra = c * 1000 + 1000
    count = sum(p.numel() for p in m.parameters()) + extra
    assert abs(count - official) / official < 0.01, count
    assert abs(count - official) < 0.01e6  # in fact equal to the reported 2 decimals


def test_paper_param_counts_of_the_unreleased_variants():
    """PVTv2 / DeiT Pola variants have no official code; without per-block position encodings the
    counts match the paper (3.4M, 13M, 6.1M), which is why their configs use use_pos_enc=False."""
    cfg = dict(type='PolaLinearAttention', use_pos_enc=False)
    with torch.device('meta'):
        b0 = LinAttnPVTv2(arch='b0', attn_cfg=cfg, out_indices=(3, ))
        b1 = LinAttnPVTv2(arch='b1', attn_cfg=cfg, out_indices=(3, ))
        deit = LinAttnViT(arch='t', attn_cfg=dict(cfg, qkv_layout='qkvg'), out_type='cls_token')

    def count(m, c):
        return sum(p.numel() for p in m.parameters()) + c * 1000 + 1000
    assert round(count(b0, 256) / 1e6, 1) == 3.4
    assert round(count(b1, 512) / 1e6) == 13
    assert 6.1e6 <= count(deit, 192) < 6.2e6


# ------------------------------------------------------------------------------------------------
# skeletons at odd sizes
# ------------------------------------------------------------------------------------------------
def _pvt_t():
    return LinAttnPVT(arch='t', attn_cfg=POLA_PVT)


def _swin_t():
    return LinAttnSwin(arch='t', attn_cfg=SWIN_LLSS)


def _pvtv2_b0():
    return LinAttnPVTv2(arch='b0', attn_cfg=dict(POLA_PVT, use_pos_enc=False))


def _deit_t():
    return LinAttnViT(arch='t', attn_cfg=dict(POLA_L, use_pos_enc=False))


@pytest.mark.parametrize('build,channels', [
    (_pvt_t, (64, 128, 320, 512)), (_swin_t, (96, 192, 384, 768)),
    (_pvtv2_b0, (32, 64, 160, 256)), (_deit_t, (192, 192, 192, 192)),
])
@pytest.mark.parametrize('size', [(33, 47), (200, 334)])
def test_skeleton_output_shapes_at_odd_sizes(build, channels, size):
    torch.manual_seed(0)
    assert_pyramid_outputs(build(), size, channels, plain_vit=build is _deit_t)


# ------------------------------------------------------------------------------------------------
# mixed precision
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('layout,extra', [('qg_kv', 0), ('qkvg', 1)])
def test_no_overflow_under_autocast(dtype, layout, extra):
    torch.manual_seed(0)
    m = PolaLinearAttention(64, 2, qkv_layout=layout, pretrain_hw=(8, 8), num_extra_tokens=extra)
    with torch.no_grad():  # a sharp, cold model: p close to 5, small temperature
        m.power.fill_(3.)
        m.scale.fill_(-1.)
    x = (torch.randn(2, extra + 9 * 11, 64) * 100).requires_grad_()
    with torch.autocast('cpu', dtype=dtype):
        y = m(x, (9, 11))
    # the unguarded feature map would overflow fp16: relu(q/s)^p far beyond 65504
    q = (x @ m.qg.weight[:64].T if layout == 'qg_kv' else x @ m.qkvg.weight[:64].T).detach()
    assert (F.relu(q / F.softplus(m.scale)) ** m.exponent().max()).max() > 1e6
    assert torch.isfinite(y).all()
    y.float().square().mean().backward()
    assert torch.isfinite(x.grad).all()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    with torch.no_grad():
        full = m(x.detach(), (9, 11))
    rel = (y.float() - full).norm() / full.norm()
    assert rel < (0.05 if dtype == torch.bfloat16 else 0.01), rel


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_backbone_no_overflow_under_autocast(dtype):
    torch.manual_seed(0)
    arch = dict(embed_dims=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 4])
    m = LinAttnSwin(arch=arch, attn_cfg=SWIN_LLSS)
    for blk in (m.layers[0].blocks[0], m.layers[1].blocks[0]):
        with torch.no_grad():
            blk.attn.power.fill_(3.)
            blk.attn.scale.fill_(-1.)
    x = torch.randn(2, 3, 64, 96) * 100
    with torch.autocast('cpu', dtype=dtype):
        outs = m(x)
    assert all(torch.isfinite(o).all() for o in outs)
    sum(o.float().square().mean() for o in outs).backward()
    for name, p in m.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), name


# ------------------------------------------------------------------------------------------------
# Pola-Swin-S fine-tuned at 384² (paper Table 5, last row)
# ------------------------------------------------------------------------------------------------
#: classifier of configs/polaformer/pola-swin-s-384_in1k.py, 1000-class head included: counted here
POLA_SWIN_S_384_PARAMS = 52_449_680


def test_pola_swin_s_384_config(tmp_path):
    from linattn_mm.apis import build_model, get_config
    cfg = get_config('configs/polaformer/pola-swin-s-384_in1k.py')
    b = cfg.model.backbone
    assert b.pretrain_img_size == 384 and b.arch == 's'
    model = build_model(cfg, pretrained_backbone=False)
    assert sum(p.numel() for p in model.parameters()) == POLA_SWIN_S_384_PARAMS
    net = model.backbone
    sd = net.state_dict()
    # position encodings sized for the 384 grid (96x96, 48x48), as the official Swin-B-384
    assert sd['layers.0.blocks.0.attn.positional_encoding'].shape == (1, 96 * 96, 96)
    assert sd['layers.1.blocks.1.attn.positional_encoding'].shape == (1, 48 * 48, 192)
    # window-12 softmax in stages 3-4: (2*12-1)^2 relative positions; the 12x12 stage 4 unshifted
    assert sd['layers.2.blocks.0.attn.relative_position_bias_table'].shape == (23 * 23, 12)
    assert sd['layers.3.blocks.1.attn.relative_position_bias_table'].shape == (23 * 23, 24)
    assert [blk.attn.shift_size for blk in net.layers[2].blocks[:2]] == [0, 6]
    assert all(blk.attn.shift_size == 0 for blk in net.layers[3].blocks)
    # the same model as the 224 one but for the size-dependent tables: 1.75M more position rows
    # (2 blocks x (9216 - 3136) x 96 + 2 blocks x (2304 - 784) x 192) and 529 - 169 more relative
    # positions per head (18 blocks x 12 heads + 2 blocks x 24 heads)
    s224 = build_model(get_config('configs/polaformer/pola-swin-s_in1k.py'),
                       pretrained_backbone=False)
    diff = POLA_SWIN_S_384_PARAMS - sum(p.numel() for p in s224.parameters())
    assert diff == 2 * 6080 * 96 + 2 * 1520 * 192 + (529 - 169) * (18 * 12 + 2 * 24)
    # a 224 backbone file loads into the 384 model, position and bias tables resized
    torch.save({'model': s224.backbone.state_dict()}, tmp_path / 'w.pth')
    net.init_cfg = dict(type='Pretrained', checkpoint=str(tmp_path / 'w.pth'))
    net.init_weights()
    report = net.pretrained_load_report
    assert 'layers.0.blocks.0.attn.positional_encoding' in report.resized
    assert 'layers.2.blocks.0.attn.relative_position_bias_table' in report.resized
    assert not report.missing
