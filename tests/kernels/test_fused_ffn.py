"""The chunked in-place FFN kernel (:mod:`linattn_mm.ops.ffn`) against the FFN formula written out
here, and its use in the inference form of ``TransformerBlock`` (:func:`linattn_mm.deploy.convert`:
inference only; the PVTv2 depth-wise conv FFN keeps its plain form); the GEMM patch embedding."""
import math

import pytest
import torch
from harness import assert_inference_only, record_calls
from oracles.ffn import hidden_formula

import linattn_mm.deploy.blocks as deploy_blocks
from linattn_mm import deploy
from linattn_mm.models.backbones import LinAttnPVT, LinAttnSwin
from linattn_mm.models.utils.layers import TransformerBlock
from linattn_mm.ops.ffn import CPU_CHUNK_ROWS, ffn_residual_


def ffn_formula(x, ln_w, ln_b, eps, w1, b1, w2, b2, approximate='none'):
    """x + W2 gelu(W1 LN(x) + b1) + b2, each step from its definition (float64 inputs)."""
    h = hidden_formula(x, ln_w, ln_b, eps, w1, b1, approximate)
    return x + h @ w2.T + (0 if b2 is None else b2)


def params(C, hidden, bias=True, affine=True, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return ((1 + 0.3 * r(C)) if affine else None, 0.3 * r(C) if affine else None, 1e-6,
            r(hidden, C) / math.sqrt(C), 0.2 * r(hidden) if bias else None,
            r(C, hidden) / math.sqrt(hidden), 0.2 * r(C) if bias else None)


@pytest.mark.parametrize('shape,rows', [((2, 37, 12), 16), ((3, 50, 8), 7), ((1, 5, 16), 1000),
                                        ((2, 1100, 6), None), ((0, 4, 8), None)])
@pytest.mark.parametrize('bias,affine,approximate', [(True, True, 'none'), (False, False, 'none'),
                                                     (True, True, 'tanh')])
def test_kernel_matches_formula(shape, rows, bias, affine, approximate):
    C = shape[-1]
    p = params(C, 3 * C + 1, bias, affine)
    x = torch.randn(*shape, dtype=torch.float64)
    want = ffn_formula(x, *p, approximate)
    got = x.clone()
    out = ffn_residual_(got, *p, approximate=approximate, rows=rows)
    assert out is got  # in place
    assert got.shape == want.shape
    if want.numel():
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-12, err


def test_kernel_float32_equals_plain_module_form():
    """1024-row chunks (the CPU default) against ``x + fc2(gelu(fc1(norm(x))))`` run whole."""
    torch.manual_seed(0)
    norm, fc1, fc2 = torch.nn.LayerNorm(32), torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)
    x = torch.randn(3, 1000, 32)  # 3000 rows: two full chunks and one partial
    assert x.shape[0] * x.shape[1] > 2 * CPU_CHUNK_ROWS
    with torch.no_grad():
        want = x + fc2(torch.nn.functional.gelu(fc1(norm(x))))
        got = ffn_residual_(x.clone(), norm.weight, norm.bias, norm.eps, fc1.weight, fc1.bias,
                            fc2.weight, fc2.bias)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-6, err


def test_kernel_rejects_bad_input():
    p = params(8, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match='contiguous'):
        ffn_residual_(torch.randn(8, 4, 2).transpose(0, 2), *p)
    with pytest.raises(ValueError, match='do not match 6 input channels'):
        ffn_residual_(torch.randn(2, 6), *p)
    with pytest.raises(ValueError, match='rows must be positive'):
        ffn_residual_(torch.randn(2, 8), *p, rows=0)


def make_block(dwconv=False):
    torch.manual_seed(1)
    blk = TransformerBlock(16, 2, dict(type='SRSoftmaxAttention'), mlp_ratio=3,
                           dwconv_mlp=dwconv)
    with torch.no_grad():
        for p in blk.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return blk


@pytest.fixture
def kernel_calls(monkeypatch):
    return record_calls(monkeypatch, deploy_blocks, 'ffn_residual_')


def test_block_uses_kernel_in_inference_with_same_output(kernel_calls):
    blk = make_block().eval()
    x = torch.randn(2, 30, 16)
    with torch.no_grad():
        plain = blk(x, (5, 6))
        assert kernel_calls == []
        deploy.convert(blk)
        fused = blk(x, (5, 6))
    assert kernel_calls == [(2, 30, 16)]
    assert torch.allclose(fused, plain, rtol=1e-6, atol=1e-6)
    assert not torch.equal(fused, x)  # the block input is not overwritten
    with torch.inference_mode():
        assert torch.allclose(blk(x, (5, 6)), plain, rtol=1e-6, atol=1e-6)
    assert len(kernel_calls) == 2


def test_block_plain_where_kernel_cannot_run(kernel_calls):
    blk = make_block()
    x = torch.randn(1, 12, 16)
    blk.train()
    blk(x, (3, 4))  # training
    blk.eval()
    blk(x, (3, 4)).sum().backward()  # eval with gradients (e.g. fine-tuning with frozen BN)
    assert blk.mlp.fc1.weight.grad is not None
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        blk(x, (3, 4))
    dw = deploy.convert(make_block(dwconv=True).eval())  # PVTv2 FFN: no inference form
    assert type(dw) is TransformerBlock
    with torch.no_grad():
        dw(x, (3, 4))
    assert kernel_calls == []
    # frozen parameters and an input without grad: inference even with autograd on
    for p in blk.parameters():
        p.requires_grad_(False)
    deploy.convert(blk)(x, (3, 4))
    assert kernel_calls == [(1, 12, 16)]


def test_block_inference_form_names_the_problem():
    x = torch.randn(1, 12, 16)
    blk = deploy.convert(make_block().eval())
    assert_inference_only(blk, lambda: blk(x, (3, 4)), lambda: blk(x, (3, 4)))
    assert 'depth-wise conv' in deploy_blocks.TransformerBlockCPU.unsupported(
        make_block(dwconv=True))


@pytest.mark.parametrize('kind', ['pvt', 'swin'])
def test_backbone_fused_equals_plain(kind, kernel_calls):
    """Whole Pola backbones in eval: converted (fused FFN) against the plain form."""
    torch.manual_seed(0)
    pola = dict(type='PolaLinearAttention')
    if kind == 'pvt':
        net = LinAttnPVT(arch=dict(embed_dims=[16, 32, 40, 64], depths=[1, 2, 1, 1],
                                   num_heads=[1, 2, 5, 8], mlp_ratios=[2, 2, 2, 2],
                                   sr_ratios=[8, 4, 2, 1]), attn_cfg=pola, pretrain_img_size=64)
    else:
        net = LinAttnSwin(arch=dict(embed_dims=24, depths=[1, 1, 2, 1], num_heads=[3, 3, 6, 12]),
                          attn_cfg=[pola, pola, dict(type='WindowSoftmaxAttention'),
                                    dict(type='WindowSoftmaxAttention')], pretrain_img_size=64)
    net.eval()
    blocks = [m for m in net.modules() if isinstance(m, TransformerBlock)]
    x = torch.randn(2, 3, 72, 88)
    with torch.no_grad():
        fused = deploy.convert(net)(x)
        assert len(kernel_calls) == len(blocks) > 4
        plain = deploy.revert(net)(x)
    assert len(kernel_calls) == len(blocks)
    for a, b in zip(fused, plain):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 1e-5, err


def test_mac_count_runs_the_plain_ffn_and_restores_the_setting():
    """The counter names MACs after modules: the FFN's fc1 / fc2 are counted as such (the fused
    kernel would bypass them) and every converted block is converted again afterwards."""
    from linattn_mm.flops import count_macs
    torch.manual_seed(0)
    net = LinAttnPVT(arch=dict(embed_dims=[16, 32, 40, 64], depths=[1, 1, 1, 1],
                               num_heads=[1, 2, 5, 8], mlp_ratios=[2, 2, 2, 2],
                               sr_ratios=[8, 4, 2, 1]), pretrain_img_size=64).eval()
    blocks = [m for m in net.modules() if isinstance(m, TransformerBlock)]
    deploy.convert(blocks[1])
    macs = count_macs(net, torch.randn(1, 3, 64, 64))
    # stage 1: 16 x 16 tokens, 16 -> 32 -> 16 channels
    assert macs.by_module['block1.0.mlp.fc1'] == 256 * 16 * 32
    assert macs.by_module['block1.0.mlp.fc2'] == 256 * 32 * 16
    assert type(blocks[0]) is TransformerBlock
    assert type(blocks[1]) is deploy_blocks.TransformerBlockCPU


@pytest.mark.parametrize('cin,cout,p,hw,channels_last', [(3, 16, 4, (37, 50), False),
                                                          (8, 12, 2, (10, 14), True),
                                                          (8, 12, 2, (9, 7), True)])
def test_patch_embedding_gemm_form_equals_the_conv(cin, cout, p, hw, channels_last, monkeypatch):
    """The CPU inference form embeds non-overlapping patches with one GEMM on the gathered
    patches; the strided conv (the plain form) gives the same tokens and grid, padding at the
    bottom/right included."""
    from linattn_mm.models.utils.layers import PatchEmbed
    torch.manual_seed(0)
    pe = PatchEmbed(cin, cout, p, p).double().eval()
    with torch.no_grad():
        pe.norm.weight.normal_()
    x = torch.randn(2, cin, *hw, dtype=torch.float64)
    if channels_last:  # a stage output: tokens viewed as NCHW
        x = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    calls = record_calls(monkeypatch, deploy_blocks.PatchEmbedCPU, 'forward')
    want, want_hw = pe(x)  # the plain form: the conv
    deploy.convert(pe)
    with torch.no_grad():
        got, got_hw = pe(x)
    assert calls == [(2, cin, *hw)]
    deploy.revert(pe)
    with torch.no_grad():
        plain, _ = pe(x)  # unconverted: the conv in inference too
    assert torch.equal(plain, want.detach())
    assert calls == [(2, cin, *hw)] and got_hw == want_hw == (-(-hw[0] // p), -(-hw[1] // p))
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-12


def test_mac_count_names_the_window_and_patch_embedding_modules():
    """The inference forms of the window attention (windows in groups) and of the patch embedding
    (one GEMM) bypass ``qkv`` / ``proj``; the counter runs their plain forms, so the per-module
    counts keep those names, and the forms are back afterwards."""
    from linattn_mm.deploy.mixers import WindowSoftmaxAttentionCPU
    from linattn_mm.flops import count_macs
    from linattn_mm.models.attentions.softmax import WindowSoftmaxAttention
    from linattn_mm.models.utils.layers import PatchEmbed
    net = LinAttnSwin(arch=dict(embed_dims=24, depths=[1, 1, 2, 1], num_heads=[3, 3, 6, 12]),
                      attn_cfg=dict(type='WindowSoftmaxAttention'), pretrain_img_size=64).eval()
    windows = [m for m in net.modules() if isinstance(m, WindowSoftmaxAttention)]
    deploy.convert(net)
    deploy.revert(windows[1])
    macs = count_macs(net, torch.randn(1, 3, 64, 64))
    # 16 x 16 tokens of 24 channels from 4 x 4 patches of 3 channels; the window-7 attention's
    # projections run on the 16 x 16 tokens (the padding to 21 x 21 gets the projection of zeros,
    # its bias, and its outputs are dropped)
    assert macs.by_module['patch_embed.proj'] == 256 * 24 * 3 * 16
    assert macs.by_module['layers.0.blocks.0.attn.qkv'] == 256 * 24 * 72
    assert macs.by_module['layers.0.blocks.0.attn.proj'] == 256 * 24 * 24
    assert type(windows[0]) is WindowSoftmaxAttentionCPU
    assert type(windows[1]) is WindowSoftmaxAttention
    pe = net.patch_embed
    assert isinstance(pe, PatchEmbed) and type(pe) is deploy_blocks.PatchEmbedCPU
