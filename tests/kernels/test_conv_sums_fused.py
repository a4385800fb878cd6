"""NaLaFormer blocks' fused conv sums (:mod:`linattn_mm.ops.ffn.fused`, a block's
``ffn_core='fused'``): the ConvFFN's ``h + dwconv(h)`` and the CPEs' ``x + cpe(x)`` as Triton
kernels, forward and backward. Without a GPU the kernels run in Triton's interpreter on CPU
tensors (a subprocess with ``TRITON_INTERPRET=1``, ``tests/kernels/triton_interpret_checks.py
conv-fused``): against the formula written tap by tap in float64, the Functions against plain
autograd of the modules in float64, a block under bf16 autocast against its default form. On
``meta`` tensors each launch is one operation with the bytes it reads and writes."""
import pytest
import torch

import linattn_mm.ops.ffn.fused as ff
from linattn_mm.cli import set_attention_core
from linattn_mm.models.backbones.nalaformer import ConvFFN, NaLaBlock, NaLaFormer
from linattn_mm.ops.dispatch import fused_chunks
from linattn_mm.utils import PeakMemoryCounter, TrafficCounter, meta_autocast
from harness import NALA_NETWORK_FLOAT32_SHORTFALL, triton_interpret_checks

pytestmark = pytest.mark.skipif(ff.triton is None, reason='Triton is not installed')

BF16_ULP = 2 ** -7  # one unit in the last place of bfloat16, relative


@pytest.fixture(scope='module')
def interpreted():
    return triton_interpret_checks('conv-fused')


@pytest.mark.slow  # the interpreter: about 3.5 min of CPU for all
def test_the_kernel_is_the_window_sum(interpreted):
    # channels-last and NCHW maps, 3x3 and 5x5 kernels, with and without bias, flipped (the conv's
    # input gradient) and times gelu'(pre): float32 within 1e-6 of the float64 formula
    cases = {k: v for k, v in interpreted.items() if k.startswith('conv_sum ') and
             ('nhwc' in k or 'nchw' in k)}
    assert len(cases) == 6
    for name, err in cases.items():
        assert err < 1e-6, (name, err)


@pytest.mark.slow  # the interpreter: about 3.5 min of CPU for all
def test_the_kernel_rounds_as_autocast_runs_the_conv(interpreted):
    # the conv in bf16 (input, weights, bias and output rounded to nearest) and the sum rounded
    # to its dtype: a bf16 map, and a float32 map (the CPE's) whose sum stays float32; the
    # half-precision copy the CPE keeps is the input rounded
    for name in ('bf16 map', 'fp32 map, bf16 conv'):
        assert interpreted[f'conv_sum {name}: largest difference (ulps)'] <= 1.0
        assert interpreted[f'conv_sum {name}: elements off its rounding'] < 0.01
        assert interpreted[f'conv_sum {name}: copy differences'] == 0
    # NaNs (three in the map, each in up to nine windows) stay NaN where the plain form has them
    assert interpreted['conv_sum NaN: places that differ from the plain form'] == 0
    assert interpreted['conv_sum NaN: NaNs in the sum'] >= 3


@pytest.mark.slow  # the interpreter: about 3.5 min of CPU for all
def test_convffn_and_cpe_gradients_equal_plain_autograd(interpreted):
    # output and the gradients of the input and every parameter (LayerNorm, fc1, the depth-wise
    # conv, fc2; the CPE's weight and bias), float32 against the modules in float64
    cases = {k: v for k, v in interpreted.items() if k.startswith(('ConvFFN fused', 'CPE fused'))}
    assert len(cases) == 4
    for name, err in cases.items():
        assert err < 1e-5, (name, err)


@pytest.mark.slow  # the interpreter: about 3.5 min of CPU for all
def test_the_residual_sums_backward_equals_the_formula(interpreted):
    # x + b * f with a layer scale (1, C, 1, 1) or a per-image factor (B, C, 1, 1), b
    # channels-last or NCHW, one chunk of tokens or many, maps whose H and W do not merge and
    # W = 1 slices of larger maps: the output and the gradients of x, b and f against float64
    # (b's in bf16 within its rounding); a block with stochastic depth (the same masks) as its
    # default form
    cases = {k: v for k, v in interpreted.items() if k.startswith('ScaledAddFused ')}
    assert len(cases) == 5
    for name, err in cases.items():
        assert err < (2 ** -8 if 'bf16' in name else 1e-5), (name, err)
    assert interpreted['drop path block fp32: fused against default'] < 1e-5


@pytest.mark.slow  # the interpreter: about 3.5 min of CPU for all
def test_a_block_under_bf16_autocast_computes_what_its_default_form_does(interpreted):
    # a NaLaFormer block under CPU autocast: the fused conv sums round where the plain conv and
    # add do; the CPEs' weight and bias gradients are summed in float32 (the plain form's come
    # from the bf16 conv's backward), within a unit of bf16
    assert interpreted['bf16 block: output, largest difference'] <= BF16_ULP
    for part in ('x', 'ffn.', 'cpe1.', 'cpe2.'):
        assert interpreted[f'bf16 block: gradients {part}'] <= BF16_ULP, part


@pytest.mark.slow  # the interpreter: about 3.5 min of CPU for all
@NALA_NETWORK_FLOAT32_SHORTFALL
def test_whole_nalaformers_train_on_the_fused_blocks(interpreted):
    # the released layout and NaLa in every stage, activation checkpointing: the fused blocks
    # (mixers on the torch core) within 1e-5 of the float64 reference; with the fused NaLa core
    # as well, within 1.5x the float32 error of the same network in its default forms
    for name in ('released', 'NaLa everywhere'):
        baseline = interpreted[f'train NaLaFormer {name}, with_cp, default forms (baseline)']
        assert baseline < 1e-4
        assert interpreted[f'train NaLaFormer {name}, with_cp, fused blocks'] < 1e-5
        both = interpreted[f'train NaLaFormer {name}, with_cp, fused blocks and core']
        assert both < max(1e-5, 1.5 * baseline), (name, both, baseline)
        # and every mixer's gated output fused too (ops.nala.gate_fused)
        gates = interpreted[f'train NaLaFormer {name}, with_cp, fused blocks, core and gates']
        assert gates < max(1e-5, 1.5 * baseline), (name, gates, baseline)
        # and the softmax mixers' RoPE (ops.nala.rope_fused; the NaLa-everywhere layout has none)
        rope = f'train NaLaFormer {name}, with_cp, fused blocks, core, gates and RoPE'
        if name == 'NaLa everywhere':
            assert rope not in interpreted
            continue
        assert interpreted[rope] < max(1e-5, 1.5 * baseline), (name, interpreted[rope], baseline)


def _block_step(blk, x):
    with TrafficCounter() as tc, PeakMemoryCounter(include_meta=True) as mem:
        with meta_autocast(torch.bfloat16):
            out = blk(x)
        out.float().square().mean().backward()
    blk.zero_grad(set_to_none=True)
    return tc, mem.peak_bytes


def test_a_fused_block_step_on_meta_is_its_kernels_with_their_traffic():
    # a NaLaFormer block's training step under bf16 autocast on meta: the CPEs (forward: the
    # float32 map in, its sum out and its bf16 copy; backward: the float32 gradient in, the
    # input's gradient out and the gradient's bf16 copy) and the ConvFFN's sum (forward; backward
    # again, then the flipped sum times gelu'), each one operation; and the backward of the two
    # residual sums with their layer scale (the float32 gradient and the bf16 branch in, the
    # branch's gradient and the sums for the scale out)
    B, C, H, W, R = 2, 16, 6, 10, 64
    blk = NaLaBlock(C, 2, dict(type='NormAwareLinearAttention'), mlp_ratio=4).to('meta').train()
    blk.ffn_core = 'fused'
    x = torch.empty(B, C, H, W, device='meta', requires_grad=True)
    tc, _ = _block_step(blk, x)
    splits = fused_chunks(H * W, B, 64, torch.device('meta'))[0]  # C = 16: one channel tile
    residual = 4 * B * C * H * W + 2 * B * C * H * W + 4 * C + 2 * B * C * H * W \
        + 4 * B * splits * C
    assert [r[1] for r in tc.records if r[0] == 'scaled_add_grads'] == [residual] * 2
    sums = [r[1] for r in tc.records if r[0] == 'conv_sum']
    c_map, r_map = B * C * H * W, B * H * W * R
    cpe = 4 * c_map + 2 * (9 * C + C) + 4 * c_map + 2 * c_map  # x, weight, bias -> sum, copy
    cpe_grad = 4 * c_map + 2 * 9 * C + 4 * c_map + 2 * c_map  # grad, weight -> dx, copy
    ffn = 2 * r_map + 2 * (9 * R + R) + 2 * r_map  # gelu(fc1), weight, bias -> sum
    ffn_grad = 2 * r_map + 2 * 9 * R + 2 * r_map + 2 * r_map  # dz, weight, fc1 out -> its grad
    assert sums == [cpe, cpe, ffn, ffn, ffn_grad, cpe_grad, cpe_grad]
    assert x.grad is not None and x.grad.shape == x.shape


def test_a_nalaformer_step_moves_fewer_bytes_on_the_fused_blocks():
    # NaLaFormer-T's stage-1 block at 800 x 1344 (batch 2, bf16 autocast, meta; its mixer on the
    # fused core): 13 % fewer bytes than the default form (8.67 against 9.94 GB), no more memory
    blk = NaLaBlock(64, 1, dict(type='NormAwareLinearAttention', core='fused'),
                    mlp_ratio=4).to('meta').train()
    x = torch.empty(2, 64, 200, 336, device='meta', requires_grad=True)
    moved = {}
    for core in ('fast', 'fused'):
        blk.ffn_core = core
        tc, peak = _block_step(blk, x)
        moved[core] = (len(tc.records), tc.bytes_moved, peak)
    assert moved['fused'][0] < moved['fast'][0], moved
    assert moved['fused'][1] < 0.9 * moved['fast'][1], moved
    assert moved['fused'][2] <= moved['fast'][2], moved


def test_the_attention_core_switch_takes_the_blocks_along(monkeypatch):
    # --attn-core fused (cli.set_attention_core) puts the blocks on their fused conv sums, and any
    # other core back on their default form; blocks with dropout keep their plain modules
    monkeypatch.setenv('TRITON_INTERPRET', '1')  # the device check: Triton may run here
    net = NaLaFormer(arch=dict(embed_dims=[16, 32, 32, 32], depths=[1, 1, 1, 1],
                               num_heads=[1, 2, 2, 2], mlp_ratios=[2, 2, 2, 2]))
    set_attention_core(net, 'fused')
    assert [b.ffn_core for s in net.layers for b in s.blocks] == ['fused'] * 4
    set_attention_core(net, 'fast')
    assert [b.ffn_core for s in net.layers for b in s.blocks] == ['fast'] * 4
    net = NaLaFormer(arch=dict(embed_dims=[16, 32, 32, 32], depths=[1, 1, 1, 1],
                               num_heads=[1, 2, 2, 2], mlp_ratios=[2, 2, 2, 2]), drop_rate=0.1)
    set_attention_core(net, 'fused')
    assert [b.ffn_core for s in net.layers for b in s.blocks] == ['reference'] * 4


def test_bad_convs_devices_and_dtypes_are_named(monkeypatch):
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    ffn = ConvFFN(8, 32)
    norm = torch.nn.LayerNorm(8)
    x = torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match='ConvFFN: the fused kernels run on CUDA.*on cpu'):
        ff.conv_ffn_branch_fused(x, norm, ffn)
    conv = torch.nn.Conv2d(8, 8, 3, 1, 1, groups=8)
    with pytest.raises(ValueError, match='CPE: the fused kernels run on CUDA'):
        ff.conv_residual_fused(x.permute(0, 3, 1, 2), conv)
    monkeypatch.setenv('TRITON_INTERPRET', '1')
    with pytest.raises(ValueError, match='CPE: the fused conv sums take a depth-wise conv'):
        ff.conv_residual_fused(x.permute(0, 3, 1, 2), torch.nn.Conv2d(8, 8, 3, 2, 1, groups=8))
    with pytest.raises(ValueError, match='odd square kernel'):
        ff.check_fused_conv('CPE', torch.nn.Conv2d(8, 8, 4, 1, 2, groups=8))
    with pytest.raises(ValueError, match='odd square kernel'):
        ff.check_fused_conv('CPE', torch.nn.Conv2d(8, 16, 3, 1, 1, groups=8))
    with pytest.raises(ValueError, match='the input is torch.float64'):
        ff.conv_residual_fused(x.permute(0, 3, 1, 2).double(), conv.double())
    ffn.act.approximate = 'tanh'
    with pytest.raises(ValueError, match="exact GELU.*approximate='tanh'"):
        ff.conv_ffn_branch_fused(x, norm, ffn)
    ff.check_fused_conv('CPE', torch.nn.Conv2d(8, 8, 3, 1, 'same', groups=8))  # taken
    with pytest.raises(ValueError, match="padding_mode='reflect'"):
        ff.check_fused_conv('CPE', torch.nn.Conv2d(8, 8, 3, 1, 1, groups=8,
                                                   padding_mode='reflect'))
    # the switch checks every conv before it switches any block
    net = NaLaFormer(arch=dict(embed_dims=[16, 32, 32, 32], depths=[1, 1, 1, 1],
                               num_heads=[1, 2, 2, 2], mlp_ratios=[2, 2, 2, 2]))
    net.layers[2].blocks[0].cpe2 = torch.nn.Conv2d(32, 32, 3, 1, 1, groups=32,
                                                   padding_mode='circular')
    with pytest.raises(ValueError, match=r'layers\.2\.blocks\.0\.cpe2: the fused conv sums'):
        set_attention_core(net, 'fused')
    assert all(b.ffn_core == 'fast' for s in net.layers for b in s.blocks)
    blk = NaLaBlock(8, 2, dict(type='NormAwareLinearAttention'))
    blk.ffn_core = 'triton'
    with pytest.raises(ValueError, match="NaLaBlock: core must be one of"):
        blk.ffn_branch(x.permute(0, 3, 1, 2))
