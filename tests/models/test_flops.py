"""MAC counting that sees the attention matmuls: analytic counts of the softmax references and of
Poly-SA, the gap of mmengine's module-hook counter (it misses scaled-dot-product attention), a
backbone next to its published figure, and tools/get_flops.py on a detector config."""
import runpy

import pytest
import torch

import linattn_mm  # noqa: F401
from linattn_mm.flops import count_macs
from linattn_mm.models.attentions import build_attention
from linattn_mm.models.backbones import LinAttnViT


def mixer(cfg, C=64, heads=2, **ctx):
    return build_attention(cfg, embed_dims=C, num_heads=heads, **ctx).eval()


def test_global_softmax_attention_count_is_analytic():
    N, C = 196, 64
    m = mixer(dict(type='GlobalSoftmaxAttention'))
    # qkv + proj linears 4NC^2, logits and weighted sum 2N^2C
    assert count_macs(m, torch.randn(1, N, C), (14, 14)).total == 4 * N * C * C + 2 * N * N * C


@pytest.mark.parametrize('block_idx', [0, 1])
def test_window_attention_count_is_analytic(block_idx):
    N, C, n = 196, 64, 49
    m = mixer(dict(type='WindowSoftmaxAttention', window_size=7), block_idx=block_idx)
    assert count_macs(m, torch.randn(2, N, C), (14, 14)).total == 2 * (4 * N * C * C + 2 * N * n * C)


def test_spatial_reduction_attention_count_is_analytic():
    N, C, sr = 16 * 16, 64, 4
    n = N // sr ** 2
    m = mixer(dict(type='SRSoftmaxAttention'), sr_ratio=sr)
    expected = (N * C * C          # q
                + n * C * C * sr * sr  # strided sr conv
                + 2 * n * C * C    # kv
                + N * C * C        # proj
                + 2 * N * n * C)   # attention
    assert count_macs(m, torch.randn(1, N, C), (16, 16)).total == expected


def test_poly_sa_count_is_analytic():
    N, C = 14 * 14, 64
    m = mixer(dict(type='PolySelfAttention'), pretrain_hw=(14, 14))
    # qkv 3NC^2, the p2 pooling N*C, the 3x3 depth-wise projection 9NC (products count 0)
    assert count_macs(m, torch.randn(1, N, C), (14, 14)).total == 3 * N * C * C + N * C + 9 * N * C


def test_mmengine_counter_misses_the_attention_product():
    from mmengine.analysis import FlopAnalyzer
    N, C = 196, 64
    m = mixer(dict(type='GlobalSoftmaxAttention'))
    x = torch.randn(1, N, C)
    theirs = FlopAnalyzer(m, (x, (14, 14))).total()
    ours = count_macs(m, x, (14, 14)).total
    assert ours - theirs == 2 * N * N * C  # exactly the logits and the weighted sum


def test_deit_tiny_next_to_published_figure():
    m = LinAttnViT(arch='t', out_type='cls_token').eval()
    macs = count_macs(m, torch.randn(1, 3, 224, 224)).total + 192 * 1000  # + the head
    print(f'DeiT-T: {macs / 1e9:.3f} GMACs (published 1.3G)')
    assert abs(macs / 1e9 - 1.3) / 1.3 < 0.05


def test_get_flops_tool_on_a_detector(capsys):
    tool = runpy.run_path('tools/get_flops.py', run_name='get_flops')
    main = tool['main']
    res = main(['configs/poly/retinanet_poly-pvt-t_fpn_1x_coco.py', '--shape', '200', '300',
                '--depth', '1'])
    out = capsys.readouterr().out
    assert res['input_shape'] == [1, 3, 224, 320]  # padded to the size divisor 32
    # heads called through .forward() have no entry of their own: summed from their children
    rows = dict(tool['module_rows'](res['by_module'], 1))
    assert set(rows) == {'backbone', 'neck', 'bbox_head'}
    assert sum(rows.values()) == res['macs']  # nothing counted outside the three parts
    assert 'MACs' in out and 'backbone' in out
    bb = main(['configs/poly/retinanet_poly-pvt-t_fpn_1x_coco.py', '--shape', '200', '300',
               '--part', 'backbone', '--depth', '0'])
    assert bb['macs'] == rows['backbone']
    for bad in (['1', '2', '3'], ['0']):  # a shape of three sides was counted as a 1 x 1 square
        with pytest.raises(SystemExit):
            main(['configs/poly/retinanet_poly-pvt-t_fpn_1x_coco.py', '--shape'] + bad)
        assert '--shape takes H W or one side S' in capsys.readouterr().err
    from linattn_mm.flops import config_macs
    with pytest.raises(ValueError, match=r'input shape \(1, 2, 3\): give one side S or H W'):
        config_macs('configs/poly/retinanet_poly-pvt-t_fpn_1x_coco.py', (1, 2, 3))
