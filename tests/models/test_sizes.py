"""Every backbone family at every input size of the reliability issue, 32x32 up to 800x1344: the
right number of maps, strides 4/8/16/32 (ceil) and finite values. Small archs (one or two blocks
per stage) keep the 800x1344 cases cheap; the strides, padding and resizing code paths are those
of the full models. 2048x2048 is covered by tools/benchmark.py, not here."""
import pytest
import torch
from oracles.shapes import expected_pyramid_hw

from families import FAMILIES, NAT, PLAIN

from linattn_mm.models.backbones import LinAttnPVT
from linattn_mm.models.backbones.resnet_polynl import resnet_output_hw
from linattn_mm.models.backbones.setformer import SeTformer

SIZES = [(32, 32), (33, 47), (63, 63), (200, 334), (511, 769), (800, 1344)]


@pytest.fixture(scope='module')
def models():
    built = {}
    for name, make in FAMILIES.items():
        torch.manual_seed(0)
        m = make()
        m.init_weights()
        built[name] = m.eval()
    return built


@pytest.mark.parametrize('size', SIZES, ids=lambda s: f'{s[0]}x{s[1]}')
@pytest.mark.parametrize('name', list(FAMILIES))
def test_every_family_at_every_size(models, name, size):
    if name == 'r50-polynl' and size in ((63, 63), (511, 769)):
        pytest.skip('ResNet-50 is full size here; its other sizes cover the same rounding')
    torch.manual_seed(1)
    with torch.no_grad():
        outs = models[name](torch.randn(1, 3, *size))
    assert len(outs) == 4
    if name == 'r50-polynl':  # ResNet: the conv / max-pool output-size formula at each stride
        want = resnet_output_hw(*size)
    else:
        want = expected_pyramid_hw(*size, plain_vit=name in PLAIN)
    assert [tuple(o.shape[-2:]) for o in outs] == want
    assert all(torch.isfinite(o).all() for o in outs)


def test_too_small_input_names_the_minimum():
    m = LinAttnPVT(arch='t')
    with pytest.raises(ValueError, match=r'smaller than the minimum 29x29'):
        m(torch.randn(1, 3, 24, 24))


def test_nat_skeleton_gives_mixers_the_pretraining_grid():
    """Size-dependent mixer parameters (PolaFormer's positional encoding) are made for the stage
    grid at ``pretrain_img_size`` (stride 4, then 2 per stage) and resized to the input."""
    m = SeTformer(arch=NAT, pretrain_img_size=256,
                  attn_cfg=dict(type='PolaLinearAttention', qkv_layout='qkvg'))
    grids = [stage.blocks[0].attn.pos_enc_hw for stage in m.layers]
    assert grids == [(64, 64), (32, 32), (16, 16), (8, 8)]
    assert m.layers[0].blocks[0].attn.positional_encoding.shape == (1, 64 * 64, 16)
