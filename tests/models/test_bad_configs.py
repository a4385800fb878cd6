"""Bad configs across every family: an unknown attention type, option or arch is an error that
lists the valid ones (and one that names the misspelt key)."""
import pytest

import linattn_mm  # noqa: F401
from linattn_mm.models.attentions import build_attention, list_attentions
from linattn_mm.models.backbones import LinAttnPVT, LinAttnPVTv2, LinAttnSwin, LinAttnViT
from linattn_mm.models.backbones.nalaformer import NaLaFormer
from linattn_mm.models.backbones.resnet_polynl import PolyNLResNet
from linattn_mm.models.backbones.setformer import SeTformer

FAMILY_TYPES = {'GlobalSoftmaxAttention', 'WindowSoftmaxAttention', 'SRSoftmaxAttention',
                'PolaLinearAttention', 'NormAwareLinearAttention', 'NaLaSoftmaxAttention',
                'PADReMixer', 'PolySelfAttention', 'SeTAttention'}


def test_every_family_is_registered():
    assert FAMILY_TYPES <= set(list_attentions())


def test_unknown_attention_type_lists_every_family():
    with pytest.raises(KeyError) as e:
        build_attention(dict(type='PolarAttention'), embed_dims=32, num_heads=2)
    msg = str(e.value)
    assert "'PolarAttention'" in msg and all(t in msg for t in FAMILY_TYPES)


@pytest.mark.parametrize('type_name', sorted(FAMILY_TYPES))
def test_unknown_option_names_it_and_lists_valid_options(type_name):
    with pytest.raises(TypeError) as e:
        build_attention(dict(type=type_name, num_headz=4), embed_dims=32, num_heads=2)
    msg = str(e.value)
    assert "['num_headz']" in msg and 'valid options: embed_dims, num_heads' in msg


@pytest.mark.parametrize('cls,valid', [
    (LinAttnPVT, 't'), (LinAttnPVTv2, 'b0'), (LinAttnSwin, 't'), (LinAttnViT, 't'),
    (NaLaFormer, 'xt'), (SeTformer, 'm')], ids=lambda v: getattr(v, '__name__', v))
def test_unknown_arch_lists_valid_archs(cls, valid):
    with pytest.raises(KeyError) as e:
        cls(arch='huge')
    msg = str(e.value)
    assert "unknown arch 'huge'" in msg and valid in msg


def test_unknown_resnet_depth_lists_valid_depths():
    with pytest.raises(KeyError, match=r'unsupported depth 18; valid: \[50, 101\]'):
        PolyNLResNet(depth=18)


def test_attention_type_in_a_skeleton_config_is_checked():
    with pytest.raises(TypeError, match=r"SeTAttention got unknown option\(s\) \['num_ref'\]"):
        LinAttnSwin(arch='t', attn_cfg=dict(type='SeTAttention', num_ref=64))
    with pytest.raises(ValueError, match='does not support extra'):
        LinAttnViT(arch='t', attn_cfg=dict(type='WindowSoftmaxAttention'))


@pytest.mark.parametrize('cls,arch,key', [
    (LinAttnPVT, dict(embed_dims=[8] * 4, depths=[1] * 4, num_heads=[1, 1, 1], mlp_ratios=[1] * 4,
                      sr_ratios=[1] * 4), 'num_heads'),
    (LinAttnPVTv2, dict(embed_dims=[8] * 3, depths=[1] * 4, num_heads=[1] * 4, mlp_ratios=[1] * 4,
                        sr_ratios=[1] * 4), 'embed_dims'),
    (LinAttnSwin, dict(embed_dims=8, depths=[1] * 4, num_heads=[1, 1, 1]), 'num_heads'),
    (NaLaFormer, dict(embed_dims=[8] * 4, depths=[1] * 4, num_heads=[1] * 4, mlp_ratios=[1] * 5),
     'mlp_ratios'),
    (SeTformer, dict(embed_dims=8, depths=[1] * 4, num_heads=[1] * 3, mlp_ratio=1.), 'num_heads'),
], ids=lambda v: getattr(v, '__name__', None) if isinstance(v, type) else None)
def test_a_custom_arch_list_of_the_wrong_length_is_named(cls, arch, key):
    n = len(arch[key])
    with pytest.raises(ValueError, match=rf'{cls.__name__}: arch {key} has {n} entries for 4 '
                                         rf'stages \(depths=\[1, 1, 1, 1\]\)'):
        cls(arch=arch)


def test_nalaformer_default_layout_on_another_stage_count_says_so():
    arch = dict(embed_dims=[8] * 3, depths=[1] * 3, num_heads=[1] * 3, mlp_ratios=[1] * 3)
    with pytest.raises(ValueError, match=r'the default attn_cfg is the released layout of 4 '
                                         r'stages.*give attn_cfg .* for an arch of 3 stages'):
        NaLaFormer(arch=arch, out_indices=(0, 1, 2))
    m = NaLaFormer(arch=arch, out_indices=(0, 1, 2),
                   attn_cfg=dict(type='NormAwareLinearAttention'))
    assert len(m.layers) == 3


def test_vit_takes_one_attention_config_or_a_list_of_one():
    arch = dict(embed_dims=16, depth=4, num_heads=2)
    m = LinAttnViT(arch=arch, attn_cfg=[dict(type='PolaLinearAttention')])
    assert {type(b.attn).__name__ for b in m.blocks} == {'PolaLinearAttention'}
    with pytest.raises(ValueError, match=r'LinAttnViT: attn_cfg is one config for the blocks of '
                                         r'its one stage .* got a list of 2'):
        LinAttnViT(arch=arch, attn_cfg=[dict(type='PolaLinearAttention')] * 2)


def test_vit_pyramid_needs_four_increasing_blocks():
    with pytest.raises(ValueError, match=r'the pyramid takes 4 different blocks, and the arch has '
                                         r'2; use out_type cls_token'):
        LinAttnViT(arch=dict(embed_dims=16, depth=2, num_heads=2))
    with pytest.raises(ValueError, match=r'out_indices must be 4 increasing block indices in '
                                         r'\[0, 12\), got \(2, 5, 5, 11\)'):
        LinAttnViT(arch='t', out_indices=(2, 5, 5, 11))
    assert len(LinAttnViT(arch=dict(embed_dims=16, depth=2, num_heads=2),
                          out_type='avg_featmap', with_cls_token=False).blocks) == 2


@pytest.mark.parametrize('build', [
    lambda: LinAttnPVT(arch='t'), lambda: LinAttnPVTv2(arch='b0'), lambda: LinAttnSwin(arch='t'),
    lambda: LinAttnViT(arch='t'), lambda: NaLaFormer(arch='xt'), lambda: SeTformer(arch='m'),
    lambda: PolyNLResNet(depth=50)], ids=['pvt', 'pvtv2', 'swin', 'vit', 'nala', 'set', 'resnet'])
def test_an_input_that_is_not_a_batch_of_images_is_named(build):
    import torch
    m = build().eval()
    name = type(m).__name__
    with pytest.raises(ValueError, match=rf'{name} was built for 3-channel images '
                                         rf'\(in_channels=3\), got 1 channels: input '
                                         rf'\(2, 1, 64, 64\)'):
        m(torch.randn(2, 1, 64, 64))
    with pytest.raises(ValueError, match=rf'{name} takes a batch of images \(B, 3, H, W\), got '
                                         rf'\(3, 64, 64\)'):
        m(torch.randn(3, 64, 64))


def test_pvt_minimum_input_follows_the_mixers_own_reduction():
    """A mixer whose config sets its own spatial reduction (2 in every stage here, where the arch
    says 8/4/2/1) needs the stage-4 grid (stride 32) to hold 2 tokens: 33 pixels."""
    import torch
    m = LinAttnPVT(arch='t', attn_cfg=dict(type='SRSoftmaxAttention', sr_ratio=2)).eval()
    assert m.min_input_size == 33
    with torch.no_grad():
        assert len(m(torch.randn(1, 3, 33, 33))) == 4
    with pytest.raises(ValueError, match='input 32x32 is smaller than the minimum 33x33'):
        m(torch.randn(1, 3, 32, 32))
    assert LinAttnPVT(arch='t').min_input_size == 29  # arch 8/4/2/1: (8 - 1) * 4 + 1
