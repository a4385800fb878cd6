"""NaLa's gated output with its LayerNorm and gate fused (:mod:`linattn_mm.ops.nala.gate_fused`,
the NaLa mixers' ``gate_core='fused'``): ``linear(layer_norm(s) * silu(g))`` as one Triton kernel
forward and one backward around the two GEMMs. Without a GPU the kernels run in Triton's
interpreter on CPU tensors (a subprocess with ``TRITON_INTERPRET=1``,
``tests/kernels/triton_interpret_checks.py gate-fused``): against plain autograd in float64,
under bf16 autocast against the torch form, and the two NaLa mixers against float64. On ``meta``
tensors each launch is one operation with the bytes it reads and writes."""
import pytest
import torch

import linattn_mm.ops.nala.gate_fused as gf
from linattn_mm.cli import set_attention_core
from linattn_mm.models.attentions.nala import (NaLaSoftmaxAttention, NormAwareLinearAttention,
                                               set_fused_gates)
from linattn_mm.models.backbones.nalaformer import NaLaFormer
from linattn_mm.ops.dispatch import fused_chunks
from linattn_mm.ops.lean_layers import NormGatedLinear
from linattn_mm.utils import PeakMemoryCounter, TrafficCounter, meta_autocast
from harness import triton_interpret_checks

pytestmark = pytest.mark.skipif(gf.triton is None, reason='Triton is not installed')


@pytest.fixture(scope='module')
def interpreted():
    return triton_interpret_checks('gate-fused')


@pytest.mark.slow  # the interpreter: about 10 s
def test_the_function_equals_plain_autograd(interpreted):
    # output and the gradients of s, the LayerNorm's weight and bias, g (C channels of a 4C-wide
    # projection, rows 4C apart: the projection's gradient), the output projection's weight and
    # bias: float32 against float64 plain autograd, for one tile, many tiles and chunks, C = 512,
    # C = 6 with a narrower output and only g and the projection training
    cases = {k: v for k, v in interpreted.items() if k.startswith('gate fp32 ')}
    assert set(cases) == {'gate fp32 C24', 'gate fp32 C64', 'gate fp32 C512', 'gate fp32 C6'}
    for name, err in cases.items():
        assert err < 1e-6, (name, err)


@pytest.mark.slow  # the interpreter: about 10 s
def test_under_bf16_autocast_it_is_the_torch_form_or_closer_to_float64(interpreted):
    # the output (bf16, out_proj's GEMM after autocast's cast) is the torch form's within a unit
    # of bf16 (relative to its largest); each gradient is as close to float64 as the torch
    # form's (which rounds its steps to bf16) or closer
    assert interpreted['gate bf16: output against the torch form'] <= 2 ** -7
    for name in ('output', 's', 'ln weight', 'ln bias', 'g (whole projection)', 'weight',
                 'bias'):
        fused = interpreted[f'gate bf16 {name}: fused']
        torch_form = interpreted[f'gate bf16 {name}: torch form']
        assert fused < 2 ** -7 and fused <= 1.05 * torch_form, (name, fused, torch_form)


@pytest.mark.slow  # the interpreter: about 10 s
def test_both_nala_mixers_train_on_the_fused_gate(interpreted):
    # NaLa (its fused core too) and NaLa's softmax mixer: output, input and parameter gradients
    # in float32 within 1e-5 of float64 on their reference forms
    for cls in ('NormAwareLinearAttention', 'NaLaSoftmaxAttention'):
        assert interpreted[f'gate train {cls}'] < 1e-5, cls


def _records(run):
    with TrafficCounter() as tc, PeakMemoryCounter(include_meta=True) as mem:
        run()
    return tc, mem.peak_bytes


def test_a_step_on_meta_is_two_launches_with_their_traffic():
    # under bf16 autocast: forward one launch (s float32, g bf16, the LayerNorm's weight and bias
    # in; y bf16 out), backward one (s, g, the bf16 gradient u = grad W, the LayerNorm's weight
    # and bias in; y again, dg bf16, ds float32 and the partial sums out; the statistics
    # recomputed, none stored); the GEMMs around them
    T, C = 2 * 500, 32
    s = torch.empty(2, 500, C, device='meta', requires_grad=True)
    g = torch.empty(2, 500, 4 * C, device='meta', dtype=torch.bfloat16)[..., :C].requires_grad_()
    ln, lin = torch.nn.LayerNorm(C).to('meta'), torch.nn.Linear(C, C).to('meta')

    def run():
        with meta_autocast(torch.bfloat16):
            y = gf.NormGatedLinearFused.apply(s, ln.weight, ln.bias, 1e-5, g, lin.weight,
                                              lin.bias)
        y.float().sum().backward()

    tc, _ = _records(run)
    names = [r[0] for r in tc.records]
    assert names.count('norm_gate') == 1 and names.count('norm_gate_grads') == 1
    g_bytes = 2 * T * C  # its C channels of every row (the rows are 4C apart)
    forward = 4 * T * C + g_bytes + 4 * C + 4 * C + 2 * T * C
    splits = fused_chunks(T, 1, gf._rows(C)[0], torch.device('meta'))[0]
    backward = (4 * T * C + g_bytes + 2 * T * C + 4 * C + 4 * C
                + 2 * T * C + 2 * T * C + 4 * T * C + 2 * 4 * splits * C)
    assert [r[1] for r in tc.records if r[0] == 'norm_gate'] == [forward]
    assert [r[1] for r in tc.records if r[0] == 'norm_gate_grads'] == [backward]
    assert s.grad.dtype == torch.float32 and g.grad.dtype == torch.bfloat16
    assert ln.weight.grad.shape == (C, ) and lin.weight.grad.dtype == torch.float32


def test_the_gated_output_moves_a_third_of_the_torch_forms_bytes():
    # NaLaFormer-T's stage-1 gated output at 800 x 1344 (batch 2, 200 x 336 tokens, C = 64; bf16
    # autocast, meta), GEMMs included: fewer operations, under 40 % of the torch form's bytes
    # (38 bytes per element of s against 114), no higher peak
    s = torch.empty(2, 200 * 336, 64, device='meta', requires_grad=True)
    g = torch.empty(2, 200 * 336, 256, device='meta', dtype=torch.bfloat16)[..., 64:128]
    g.requires_grad_()
    ln, lin = torch.nn.LayerNorm(64).to('meta'), torch.nn.Linear(64, 64).to('meta')
    grad = torch.empty(2, 200 * 336, 64, device='meta', dtype=torch.bfloat16)
    moved = {}
    for fn in (NormGatedLinear, gf.NormGatedLinearFused):

        def run():
            with meta_autocast(torch.bfloat16):
                y = fn.apply(s, ln.weight, ln.bias, 1e-5, g, lin.weight, lin.bias)
            y.backward(grad)

        tc, peak = _records(run)
        moved[fn.__name__] = (len(tc.records), tc.bytes_moved, peak)
        for t in (s, g, *ln.parameters(), *lin.parameters()):  # nothing accumulates
            t.grad = None
    torch_form, fused = moved['NormGatedLinear'], moved['NormGatedLinearFused']
    assert fused[0] < torch_form[0], moved
    assert fused[1] < 0.4 * torch_form[1], moved
    assert fused[2] <= torch_form[2], moved


def test_the_attention_core_switch_takes_every_nala_mixers_gate_along(monkeypatch):
    # --attn-core fused puts every NaLa mixer's gated output on its fused form, the softmax
    # mixers of the released stages 3-4 included (their attention stays torch's, their RoPE on
    # its fused kernel: core 'fused'), any other core back on 'fast'
    monkeypatch.setenv('TRITON_INTERPRET', '1')  # the device check: Triton may run here
    net = NaLaFormer(arch=dict(embed_dims=[16, 32, 32, 32], depths=[1, 1, 1, 1],
                               num_heads=[1, 2, 2, 2], mlp_ratios=[2, 2, 2, 2]))
    mixers = [m for m in net.modules() if isinstance(m, (NormAwareLinearAttention,
                                                         NaLaSoftmaxAttention))]
    assert [type(m).__name__[:4] for m in mixers] == ['Norm', 'Norm', 'NaLa', 'NaLa']
    assert set_attention_core(net, 'fused') == 2  # the two NaLa mixers of stages 1-2
    assert [(m.core, m.gate_core) for m in mixers] == [('fused', 'fused')] * 4
    assert set_fused_gates(net, False) == 0
    set_attention_core(net, 'fused')
    set_attention_core(net, 'fast')
    assert [(m.core, m.gate_core) for m in mixers] == [('fast', 'fast')] * 4


def test_other_dtypes_take_the_torch_form_and_bad_names_are_named():
    # float64 (and a LayerNorm without affine parameters) go through the torch form: the same
    # numbers as NormGatedLinear, no kernel
    torch.manual_seed(0)
    s, g = torch.randn(2, 7, 8, dtype=torch.float64), torch.randn(2, 7, 8, dtype=torch.float64)
    ln, lin = torch.nn.LayerNorm(8).double(), torch.nn.Linear(8, 4).double()
    args = (s, ln.weight, ln.bias, 1e-5, g, lin.weight, lin.bias)
    torch.testing.assert_close(gf.norm_gated_linear_fused(*args), NormGatedLinear.apply(*args),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match='NormGatedLinearFused: s must be float32 and g float32, '
                                         'bfloat16 or float16, got torch.float64'):
        gf.NormGatedLinearFused.apply(*args)
    # a map without tokens: the torch form (an empty result and empty gradients)
    s0 = torch.randn(2, 0, 8, requires_grad=True)
    y0 = gf.norm_gated_linear_fused(s0, ln.weight.float(), ln.bias.float(), 1e-5,
                                    torch.randn(2, 0, 8), lin.weight.float(), lin.bias.float())
    y0.sum().backward()
    assert y0.shape == (2, 0, 4) and s0.grad.shape == (2, 0, 8)
    m = NaLaSoftmaxAttention(32, 2)
    m.gate_core = 'triton'
    with pytest.raises(ValueError, match=r"NaLaSoftmaxAttention gate: core must be one of "
                                         r"\('fast', 'fused'\), got 'triton'"):
        m(torch.randn(1, 12, 32), (3, 4))
