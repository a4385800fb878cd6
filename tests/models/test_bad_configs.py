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
