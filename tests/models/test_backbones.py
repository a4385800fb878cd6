"""Skeleton zoo: output shapes for odd sizes, arch zoo, standard backbone arguments."""

import pytest
import torch
from harness import released_backbones
from oracles.shapes import expected_pyramid_hw

from linattn_mm.models.backbones import LinAttnPVT, LinAttnPVTv2, LinAttnSwin, LinAttnViT

SKELETONS = [
    (LinAttnPVT, 't', [64, 128, 320, 512]),
    (LinAttnPVTv2, 'b0', [32, 64, 160, 256]),
    (LinAttnSwin, 't', [96, 192, 384, 768]),
    (LinAttnViT, 't', [192, 192, 192, 192]),
]


def expected_hw(cls, H, W):
    return expected_pyramid_hw(H, W, plain_vit=cls is LinAttnViT)


@pytest.fixture(scope='module')
def built():
    models = {}
    for cls, arch, _ in SKELETONS:
        torch.manual_seed(0)
        m = cls(arch=arch)
        m.init_weights()
        models[cls] = m.eval()
    return models


@pytest.mark.parametrize('cls,arch,channels', SKELETONS, ids=lambda v: getattr(v, '__name__', ''))
@pytest.mark.parametrize('hw', [(32, 32), (33, 47), (63, 63), (200, 334), (511, 769)])
def test_output_shapes_any_size(built, cls, arch, channels, hw):
    m = built[cls]
    with torch.no_grad():
        outs = m(torch.randn(1, 3, *hw))
    assert len(outs) == 4
    for o, c, (h, w) in zip(outs, channels, expected_hw(cls, *hw)):
        assert tuple(o.shape) == (1, c, h, w)
        assert torch.isfinite(o).all()


ARCH_PARAMS = [
    # (class, arch, millions of parameters: the published classification model minus its head,
    # e.g. Swin-T 28.29M - 0.77M, PVTv2-b0 3.67M - 0.26M, DeiT-T 5.72M - 0.19M)
    (LinAttnSwin, 't', 27.52), (LinAttnSwin, 's', 48.84), (LinAttnSwin, 'b', 86.74),
    (LinAttnPVTv2, 'b0', 3.41), (LinAttnPVTv2, 'b1', 13.50), (LinAttnPVTv2, 'b2', 24.85),
    (LinAttnViT, 't', 5.52), (LinAttnViT, 's', 21.67), (LinAttnViT, 'b', 85.80),
    # PVT v1: published 13.2M / 24.5M minus head (0.513M), class token, its position row and the
    # final norm (2K), all classification-only
    (LinAttnPVT, 't', 12.71), (LinAttnPVT, 's', 23.97), (LinAttnPVT, 'm', 43.69),
]


@pytest.mark.parametrize('cls,arch,mparams', ARCH_PARAMS,
                         ids=[f'{c.__name__}-{a}' for c, a, _ in ARCH_PARAMS])
def test_arch_zoo_parameter_counts(cls, arch, mparams):
    """Parameter counts of the standard archs (backbone only, classification-style outputs)
    within 1% of the published models minus their classifier heads."""
    kw = dict(out_type='cls_token') if cls is LinAttnViT else dict(out_indices=(3, ))
    m = cls(arch=arch, **kw)
    n = sum(p.numel() for p in m.parameters()) / 1e6
    assert n == pytest.approx(mparams, rel=0.01)


def test_unknown_arch_lists_valid():
    with pytest.raises(KeyError, match=r"unknown arch 'x'.*valid archs: .*b0.*b5"):
        LinAttnPVTv2(arch='x')
    with pytest.raises(KeyError, match='missing'):
        LinAttnSwin(arch=dict(embed_dims=32))


def test_per_stage_attention_configs():
    m = LinAttnSwin(arch=dict(embed_dims=16, depths=[1, 2, 1, 1], num_heads=[1, 2, 2, 4]),
                    attn_cfg=[dict(type='GlobalSoftmaxAttention'),
                              dict(type='GlobalSoftmaxAttention'),
                              dict(type='WindowSoftmaxAttention', window_size=3),
                              dict(type='WindowSoftmaxAttention', window_size=3)])
    kinds = [type(b.attn).__name__ for st in m.layers for b in st.blocks]
    assert kinds == ['GlobalSoftmaxAttention'] * 3 + ['WindowSoftmaxAttention'] * 2
    with pytest.raises(ValueError, match='3 entries but the arch has 4 stages'):
        LinAttnSwin(arch='t', attn_cfg=[dict(type='GlobalSoftmaxAttention')] * 3)
    with pytest.raises(ValueError, match='does not support extra'):
        LinAttnViT(arch='t', attn_cfg=dict(type='WindowSoftmaxAttention'))


def test_out_indices_and_drop_path():
    m = LinAttnPVTv2(arch='b0', out_indices=(1, 3), drop_path_rate=0.3).eval()
    outs = m(torch.randn(1, 3, 64, 64))
    assert [tuple(o.shape) for o in outs] == [(1, 64, 8, 8), (1, 256, 2, 2)]
    rates = [b.drop_path.drop_prob for i in range(4) for b in getattr(m, f'block{i + 1}')]
    assert rates[0] == 0 and rates[-1] == pytest.approx(0.3)
    assert all(a < b for a, b in zip(rates, rates[1:]))
    with pytest.raises(ValueError, match='out_indices'):
        LinAttnSwin(arch='t', out_indices=(4, ))


def test_frozen_stages_and_norm_eval():
    m = LinAttnSwin(arch='t', frozen_stages=2)
    m.train()
    frozen = [m.patch_embed, m.layers[0], m.layers[1], m.norm0, m.norm1]
    for mod in frozen:
        assert not mod.training
        assert all(not p.requires_grad for p in mod.parameters())
    assert m.layers[2].training and all(p.requires_grad for p in m.layers[2].parameters())
    all_frozen = LinAttnPVT(arch='t', frozen_stages=4)
    assert not any(p.requires_grad for p in all_frozen.parameters())
    vit = LinAttnViT(arch='t', norm_eval=True).train()
    assert not vit.fpn1[1].training or not isinstance(vit.fpn1[1], torch.nn.BatchNorm2d)


@pytest.mark.parametrize('cls,arch', [(LinAttnSwin, dict(embed_dims=16, depths=[1, 1, 2, 1],
                                                        num_heads=[1, 2, 2, 4])),
                                      (LinAttnPVTv2, 'b0')])
def test_with_cp_gives_same_gradients(cls, arch):
    torch.manual_seed(0)
    a = cls(arch=arch, drop_path_rate=0.)
    b = cls(arch=arch, drop_path_rate=0., with_cp=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 64, 64)
    for m in (a, b):
        sum(o.square().mean() for o in m(x)).backward()
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_pvt_too_small_input_names_minimum():
    m = LinAttnPVT(arch='t').eval()
    assert m.min_input_size == 29
    with pytest.raises(ValueError, match='minimum 29x29'):
        m(torch.randn(1, 3, 16, 40))


def test_vit_output_types():
    m = LinAttnViT(arch='t', out_type='cls_token').eval()
    (cls_tok, ) = m(torch.randn(2, 3, 48, 64))
    assert cls_tok.shape == (2, 192)
    m = LinAttnViT(arch='t', out_type='avg_featmap', with_cls_token=False).eval()
    assert m(torch.randn(2, 3, 48, 64))[0].shape == (2, 192)
    with pytest.raises(ValueError, match='unknown out_type'):
        LinAttnViT(arch='t', out_type='tokens')


def test_deprecated_pretrained_argument():
    with pytest.warns(DeprecationWarning):
        m = LinAttnPVTv2(arch='b0', pretrained='some.pth')
    assert m.init_cfg == dict(type='Pretrained', checkpoint='some.pth')
    with pytest.raises(TypeError):
        LinAttnPVTv2(arch='b0', pretrained=123)
    with pytest.raises(ValueError):
        LinAttnPVTv2(arch='b0', pretrained='a.pth', init_cfg=dict(type='Pretrained',
                                                                  checkpoint='b.pth'))


SMALL_ARCHS = [
    (LinAttnPVT, dict(embed_dims=[16, 32, 40, 64], depths=[1, 1, 1, 1], num_heads=[1, 2, 5, 8],
                      mlp_ratios=[4, 4, 4, 4], sr_ratios=[8, 4, 2, 1])),
    (LinAttnPVTv2, 'b0'),
    (LinAttnSwin, dict(embed_dims=16, depths=[1, 2, 1, 1], num_heads=[1, 2, 2, 4])),
    (LinAttnViT, dict(embed_dims=32, depth=4, num_heads=2)),
]


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
@pytest.mark.parametrize('cls,arch', SMALL_ARCHS, ids=[c.__name__ for c, _ in SMALL_ARCHS])
def test_autocast_inputs_x100(cls, arch, dtype):
    """Mixed precision with large inputs: no inf/NaN in outputs or gradients; bf16 outputs within
    a relative (Frobenius) error of 5% of float32."""
    torch.manual_seed(0)
    m = cls(arch=arch, drop_path_rate=0.)
    m.init_weights()
    x = torch.randn(2, 3, 64, 96) * 100
    with torch.no_grad():
        ref = m(x)
    with torch.autocast('cpu', dtype=dtype):
        outs = m(x)
    loss = sum(o.float().square().mean() for o in outs)
    loss.backward()
    for o, r in zip(outs, ref):
        assert torch.isfinite(o).all()
        if dtype is torch.bfloat16:
            assert (o.float() - r).norm() / r.norm() < 0.05
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_vit_pyramid_builds_no_final_norm_and_drops_a_checkpoints(tmp_path):
    """A featmap ViT feeds its pyramid from the blocks' outputs: it builds no final ``norm`` (whose
    parameters would get no gradient, which DDP refuses), and an official DeiT file's ``norm.*``
    is dropped and reported; the classification outputs keep the norm."""
    kw = dict(arch=dict(embed_dims=32, depth=4, num_heads=2))
    cls_model = LinAttnViT(out_type='cls_token', **kw)
    sd = {k: torch.randn_like(v) for k, v in cls_model.state_dict().items()}
    assert {'norm.weight', 'norm.bias'} <= set(sd)
    torch.save({'model': sd}, tmp_path / 'deit.pth')
    m = LinAttnViT(init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'deit.pth')), **kw)
    assert not hasattr(m, 'norm')
    m.init_weights()
    rep = m.pretrained_load_report
    assert {'norm.weight', 'norm.bias'} <= set(rep.dropped)
    assert {k.split('.')[0] for k in rep.missing} == {'fpn1', 'fpn2'}  # the new pyramid only
    assert not rep.unexpected
    torch.testing.assert_close(m.state_dict()['blocks.3.attn.qkv.weight'],
                               sd['blocks.3.attn.qkv.weight'])
    sum(o.sum() for o in m(torch.randn(1, 3, 64, 64))).backward()
    assert [n for n, p in m.named_parameters() if p.grad is None] == []


def test_vit_blocks_after_the_deepest_output_are_not_run():
    """out_indices are block indices: blocks after the deepest one are not run (no gradient
    either), and a warning names them and the default."""
    kw = dict(arch=dict(embed_dims=32, depth=8, num_heads=2))
    assert LinAttnViT(**kw).out_indices == (1, 3, 5, 7)
    with pytest.warns(UserWarning, match=r'blocks 4\.\.7 feed no output.*\(1, 3, 5, 7\)'):
        m = LinAttnViT(out_indices=(0, 1, 2, 3), **kw)
    ran = []
    for i, blk in enumerate(m.blocks):
        blk.register_forward_hook(lambda mod, inp, out, i=i: ran.append(i))
    outs = m(torch.randn(1, 3, 64, 64))
    assert ran == [0, 1, 2, 3] and len(outs) == 4
    sum(o.sum() for o in outs).backward()
    assert {n.split('.')[1] for n, p in m.named_parameters()
            if n.startswith('blocks.') and p.grad is None} == {'4', '5', '6', '7'}


@pytest.mark.slow
def test_released_dense_backbones_train_every_parameter():
    """Every backbone of a detection / segmentation config in ``configs/``: one training step on
    its outputs gives every parameter that trains a gradient (a parameter left out breaks DDP,
    which the stock configs run without ``find_unused_parameters``, and stays at its pretrained
    value)."""
    from mmdet.registry import MODELS
    backbones = released_backbones(dense_only=True)
    assert len(backbones) > 30
    unused = {}
    for path, cfg in backbones:
        torch.manual_seed(0)
        model = MODELS.build(cfg).train()
        size = max(64, getattr(model, 'min_input_size', 0))
        sum(o.float().square().mean() for o in model(torch.randn(1, 3, size, size))).backward()
        left = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        if left:
            unused[path] = left
    assert not unused, unused


@pytest.mark.parametrize('cls,arch,convs_fan_out', [
    (LinAttnPVT, 't', False), (LinAttnPVTv2, 'b0', True),
    (LinAttnSwin, dict(embed_dims=16, depths=[1, 2, 1, 1], num_heads=[1, 2, 2, 4]), False),
    (LinAttnViT, dict(embed_dims=32, depth=4, num_heads=2), False),
], ids=['pvt', 'pvtv2', 'swin', 'vit'])
def test_init_follows_the_official_code(cls, arch, convs_fan_out):
    """``init_weights`` as the official code: trunc-normal(0.02) linears, unit LayerNorms;
    convolutions at PyTorch's default (PVT v1, Swin, DeiT: their ``_init_weights`` skips them)
    or fan-out normal N(0, 2 / (k k C_out / groups)) (PVTv2); PVT v1's ``pos_embed{i}``
    trunc-normal(0.02) (they were zero); the patch-embedding LayerNorms of PVT / PVTv2 with
    PyTorch's eps 1e-5, the blocks' 1e-6."""
    torch.manual_seed(0)
    m = cls(arch=arch)
    convs = {n: c.weight.detach().clone() for n, c in m.named_modules()
             if isinstance(c, torch.nn.Conv2d)}
    assert convs
    m.init_weights()
    for n, c in m.named_modules():
        if isinstance(c, torch.nn.Conv2d):
            if convs_fan_out:
                std = (2. / (c.kernel_size[0] * c.kernel_size[1] * c.out_channels
                             // c.groups)) ** .5
                assert not torch.equal(c.weight, convs[n])
                if c.weight.numel() >= 1000:
                    assert abs(c.weight.std().item() / std - 1) < 0.1, n
            else:
                assert torch.equal(c.weight, convs[n]), n
        elif isinstance(c, torch.nn.Linear) and c.weight.numel() >= 1000:
            assert abs(c.weight.std().item() / .02 - 1) < 0.1, n
            assert c.bias is None or not c.bias.any()
    if cls is LinAttnPVT:
        for i in range(1, 5):
            pos = getattr(m, f'pos_embed{i}')
            assert abs(pos.std().item() / .02 - 1) < 0.15
    if cls in (LinAttnPVT, LinAttnPVTv2):
        assert {m.patch_embed1.norm.eps, m.patch_embed4.norm.eps} == {1e-5}
        assert m.block1[0].norm1.eps == m.block4[0].norm2.eps == 1e-6
