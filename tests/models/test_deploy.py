"""The inference conversion (:func:`linattn_mm.deploy.convert`): which modules get which form on
each device, the state dict and its keys unchanged, outputs equal to the plain model, weights
loaded after the conversion used, revert, forward hooks, and the Python API's default."""
import pytest
import torch

import linattn_mm
from linattn_mm import deploy
from linattn_mm.models.backbones import LinAttnPVT, LinAttnPVTv2, LinAttnSwin, LinAttnViT
from linattn_mm.models.backbones.nalaformer import NaLaFormer

POLA_L = dict(type='PolaLinearAttention', qkv_layout='qkvg')
WIN = dict(type='WindowSoftmaxAttention', window_size=7)
SMALL_PVT = dict(embed_dims=[16, 32, 40, 64], depths=[1, 1, 1, 1], num_heads=[1, 2, 5, 8],
                 mlp_ratios=[2, 2, 2, 2], sr_ratios=[8, 4, 2, 1])
SMALL_NALA = dict(embed_dims=[16, 32, 32, 64], depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 4],
                  mlp_ratios=[2, 2, 2, 2])

#: name -> (a small backbone, the inference forms it gets on CPU)
NETS = {
    'pola-swin': (lambda: LinAttnSwin(arch=dict(embed_dims=24, depths=[1, 1, 2, 1],
                                                num_heads=[3, 3, 6, 12]),
                                      attn_cfg=[POLA_L, POLA_L, WIN, WIN], pretrain_img_size=64),
                  {'PolaLinearAttentionCPU', 'WindowSoftmaxAttentionCPU', 'TransformerBlockCPU',
                   'PatchEmbedCPU'}),
    'pola-pvt': (lambda: LinAttnPVT(arch=SMALL_PVT, attn_cfg=dict(type='PolaLinearAttention'),
                                    pretrain_img_size=64),
                 {'PolaLinearAttentionCPU', 'TransformerBlockCPU', 'PatchEmbedCPU'}),
    'pola-swin no dwc': (lambda: LinAttnSwin(arch=dict(embed_dims=24, depths=[1, 1, 2, 1],
                                                       num_heads=[3, 3, 6, 12]),
                                             attn_cfg=[dict(POLA_L, use_dwc=False)] * 2
                                             + [WIN, WIN], pretrain_img_size=64),
                         {'PolaLinearAttentionCPU', 'WindowSoftmaxAttentionCPU',
                          'TransformerBlockCPU', 'PatchEmbedCPU'}),
    'pola-pvt polarity only': (lambda: LinAttnPVT(arch=SMALL_PVT, attn_cfg=dict(
        type='PolaLinearAttention', gate='none', use_dwc=False), pretrain_img_size=64),
        {'TransformerBlockCPU', 'PatchEmbedCPU'}),  # no dynamic gate: no chunked Pola
    'pvtv2': (lambda: LinAttnPVTv2(arch=dict(SMALL_PVT, embed_dims=[16, 32, 40, 64])),
              set()),  # overlapping patches, depth-wise conv FFN, softmax SRA: nothing to convert
    'nalaformer': (lambda: NaLaFormer(arch=SMALL_NALA),
                   {'ConvStemCPU', 'ConvPatchMergingCPU', 'NaLaBlockCPU',
                    'NormAwareLinearAttentionCPU'}),
    'pola-deit': (lambda: LinAttnViT(arch=dict(embed_dims=48, depth=4, num_heads=3),
                                     attn_cfg=dict(POLA_L, use_pos_enc=False),
                                     pretrain_img_size=64),
                  {'TransformerBlockCPU', 'PatchEmbedCPU'}),  # class token: no chunked Pola
}


def randomise_(net, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.rsplit('.', 1)[-1] in ('power', 'scale', 'positional_encoding'):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return net


@pytest.mark.parametrize('name', sorted(NETS))
def test_convert_keeps_the_state_dict_and_the_outputs(name):
    make, forms = NETS[name]
    torch.manual_seed(0)
    net = randomise_(make()).eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(1, 3, 72, 88)
    with torch.no_grad():
        plain = net(x)
        assert deploy.convert(net) is net
        assert set(deploy.converted_modules(net).values()) == forms
        after = net.state_dict()
        assert list(after) == list(before)
        assert all(torch.equal(after[k], before[k]) for k in before)
        conv = net(x)
        deploy.convert(net)  # converting twice is harmless
        assert set(deploy.converted_modules(net).values()) == forms
        assert deploy.converted_modules(deploy.revert(net)) == {}
        back = net(x)
    for a, b, c in zip(conv, plain, back):
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5
        assert torch.equal(c, b)


def test_weights_loaded_after_conversion_are_used():
    """tools/test.py converts before the runner loads the checkpoint: the inference forms keep
    nothing computed from an earlier weight (position encoding, exponents, temperature)."""
    make, _ = NETS['pola-swin']
    torch.manual_seed(0)
    src, dst = randomise_(make(), 1).eval(), randomise_(make(), 2).eval()
    x = torch.randn(1, 3, 72, 88)
    with torch.no_grad():
        want = src(x)
        deploy.convert(dst)(x)  # fills the caches with dst's own values
        dst.load_state_dict(src.state_dict())
        got = dst(x)
    for a, b in zip(got, want):
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5


def test_forward_hooks_see_unchanged_outputs_and_are_not_skipped():
    """The plain model never updates a tensor a forward hook has received (the NaLaFormer stem's
    first conv used to be followed by an in-place BatchNorm and GELU); ``convert`` leaves a module
    with forward hooks inside it unconverted, with a warning naming it."""
    torch.manual_seed(0)
    net = NaLaFormer(arch=SMALL_NALA).eval()
    seen = []
    stem_conv = net.patch_embed.proj[0]
    block = net.layers[0].blocks[0]
    handles = [stem_conv.register_forward_hook(lambda m, a, out: seen.append((out, out.clone()))),
               block.cpe1.register_forward_hook(lambda m, a, out: seen.append((out, out.clone())))]
    x = torch.randn(1, 3, 40, 48)
    with torch.no_grad():
        plain = net(x)
        assert len(seen) == 2 and all(torch.equal(t, c) for t, c in seen)
        with pytest.warns(UserWarning, match=r'with forward hooks keep their plain forward: '
                          r'patch_embed, layers\.0\.blocks\.0'):
            deploy.convert(net)
        forms = deploy.converted_modules(net)
        assert 'patch_embed' not in forms and 'layers.0.blocks.0' not in forms
        assert forms['layers.1.blocks.0'] == 'NaLaBlockCPU' and 'layers.1' not in forms
        seen.clear()
        conv = net(x)
        assert len(seen) == 2 and all(torch.equal(t, c) for t, c in seen)
    for h in handles:
        h.remove()
    for a, b in zip(conv, plain):
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5


def test_plain_forms_context_restores_the_forms():
    make, forms = NETS['pola-pvt']
    net = deploy.convert(make().eval())
    with deploy.plain_forms(net):
        assert deploy.converted_modules(net) == {}
        net(torch.randn(1, 3, 64, 64))[0].sum().backward()  # trainable inside
    assert set(deploy.converted_modules(net).values()) == forms


def test_cuda_conversion_gives_the_triton_forms_and_checks_the_device(monkeypatch):
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    make, _ = NETS['pola-swin']
    net = make().eval()
    deploy.convert(net, 'cuda')
    forms = set(deploy.converted_modules(net).values())
    if not linattn_mm.ops.dispatch.triton_available('cuda'):  # Triton not installed
        assert forms == set()
        return
    assert forms == {'PolaLinearAttentionTriton'}
    pola = [m for m in net.modules() if isinstance(m, deploy.InferenceForm)]
    assert all(m.core == 'triton' for m in pola)
    if not torch.cuda.is_available():
        with torch.no_grad(), pytest.raises(RuntimeError, match='converted for cuda and got a '
                                            'cpu input; convert again for that device'):
            net(torch.randn(1, 3, 64, 64))
    deploy.revert(net)
    assert all(m.core == 'fast' for m in pola)


@pytest.mark.parametrize('family', ['pola', 'nala'])
def test_cuda_conversion_keeps_the_torch_core_for_heads_over_32(monkeypatch, family):
    """The Triton inference core only for head dims up to ``max_head_dims`` (32: slower than the
    torch core at 64 on the GPU measured); raised on the class, larger heads take it too."""
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    if not linattn_mm.ops.dispatch.triton_available('cuda'):
        pytest.skip('Triton not installed: no CUDA forms')
    from linattn_mm.models.attentions.nala import NormAwareLinearAttention
    from linattn_mm.models.attentions.pola import PolaLinearAttention
    cls, form = ((PolaLinearAttention, deploy.PolaLinearAttentionTriton) if family == 'pola'
                 else (NormAwareLinearAttention, deploy.NormAwareLinearAttentionTriton))
    kw = dict(pretrain_hw=(8, 8)) if family == 'pola' else {}
    mixers = {d: cls(2 * d, 2, **kw).eval() for d in (16, 32, 64)}
    for m in mixers.values():
        deploy.convert(m, 'cuda')
    assert {d: type(m).__name__ for d, m in mixers.items()} == {
        16: form.__name__, 32: form.__name__, 64: cls.__name__}
    assert [m.core for m in mixers.values()] == ['triton', 'triton', 'fast']
    assert form.unsupported(mixers[64]) == (
        f'head dims 64 > 32: the torch core is faster there ({form.__name__}.max_head_dims)')
    monkeypatch.setattr(form, 'max_head_dims', 64)
    deploy.convert(mixers[64], 'cuda')
    assert type(mixers[64]) is form and mixers[64].core == 'triton'


def test_get_model_gives_a_converted_frozen_model_or_a_trainable_plain_one():
    m = linattn_mm.get_model('pola-pvt-t_in1k')
    assert not m.training and not any(p.requires_grad for p in m.parameters())
    assert 'PolaLinearAttentionCPU' in deploy.converted_modules(m).values()
    out = m(torch.randn(1, 3, 64, 64), mode='tensor')  # no torch.no_grad() needed
    assert out.shape == (1, 1000) and not out.requires_grad
    t = linattn_mm.get_model('pola-pvt-t_in1k', convert=False)
    assert deploy.converted_modules(t) == {} and all(p.requires_grad for p in t.parameters())
    t.train()(torch.randn(2, 3, 64, 64), mode='tensor').sum().backward()


@pytest.mark.parametrize('kw,reason', [
    (dict(kernel='paper'), "official kernel (kernel='paper')"),
    (dict(query_power=2.), 'norm-aware power'),
    (dict(use_lepe=False), 'LePE'),
])
def test_nala_settings_without_an_inference_form_keep_the_training_form(kw, reason):
    """The paper's form of a NaLa mixer (another kernel, a constant power, no LePE) has neither the
    chunked CPU nor the Triton form: both name the setting, and conversion leaves the mixer as it
    is (its training form, which the tests of the paper's form check)."""
    from linattn_mm.deploy.mixers import (NormAwareLinearAttentionCPU,
                                          NormAwareLinearAttentionTriton)
    from linattn_mm.models.attentions.nala import NormAwareLinearAttention
    m = NormAwareLinearAttention(32, 2, **kw)
    for form in (NormAwareLinearAttentionCPU, NormAwareLinearAttentionTriton):
        assert reason in form.unsupported(m), form
    plain = NormAwareLinearAttention(32, 2)
    assert NormAwareLinearAttentionCPU.unsupported(plain) is None
    assert NormAwareLinearAttentionTriton.unsupported(plain) is None
    net = torch.nn.Sequential(m).eval()
    x = torch.randn(1, 6 * 5, 32)
    with torch.no_grad():
        want = m(x, (6, 5))
        deploy.convert(net, 'cpu')
        assert type(net[0]) is NormAwareLinearAttention
        torch.testing.assert_close(net[0](x, (6, 5)), want, rtol=0, atol=0)
