"""The RoPE of NaLa's softmax stages as one Triton kernel each way
(:mod:`linattn_mm.ops.nala.rope_fused`, ``NaLaSoftmaxAttention(core='fused')``). Without a GPU the
kernel runs in Triton's interpreter on CPU tensors (a subprocess with ``TRITON_INTERPRET=1``,
``tests/kernels/triton_interpret_checks.py rope-fused``): against plain autograd of the reference
rotation in float64, in bfloat16 against the torch form, the mixer against float64 and under
bf16 autocast against its torch form. On ``meta`` tensors each launch is one operation with the
bytes it reads and writes."""
import os.path as osp
import runpy

import pytest
import torch

import linattn_mm.ops.nala.rope_fused as rf
from linattn_mm.cli import set_attention_core
from linattn_mm.models.attentions.nala import NaLaSoftmaxAttention, RoPE2d, set_fused_rope
from linattn_mm.models.backbones.nalaformer import NaLaFormer
from linattn_mm.ops.nala import apply_rope
from linattn_mm.utils import PeakMemoryCounter, TrafficCounter, meta_autocast
from harness import REPO, triton_interpret_checks

pytestmark = pytest.mark.skipif(rf.triton is None, reason='Triton is not installed')

#: bfloat16's unit roundoff: a float32 result rounded once to bfloat16 is within it, relative
BF16_ROUNDING = 2 ** -8


@pytest.fixture(scope='module')
def interpreted():
    return triton_interpret_checks('rope-fused')


def test_the_rotation_and_its_gradient_equal_the_reference(interpreted):
    # q as a head view of a 4C-wide projection (its gradient checked there), d = 16 in one
    # block of tokens and d = 64 in many: float32 to 1e-6 of float64 plain autograd of the
    # reference rotation, bfloat16 in and out within its rounding of it
    cases = {k: v for k, v in interpreted.items()
             if k.startswith('rope ') and k.endswith((': out', ': grad'))}
    assert len(cases) == 8
    for name, err in cases.items():
        assert err < (1e-6 if name.startswith('rope fp32') else BF16_ROUNDING), (name, err)


def test_in_bfloat16_it_is_the_torch_forms_rotation(interpreted):
    # rounded once instead of twice (float32, then autocast's cast), and yet not one element
    # differs from the torch form's
    cases = {k: v for k, v in interpreted.items() if k.startswith('rope bf16 d') and 'torch' in k}
    assert len(cases) == 4
    assert all(v == 0 for v in cases.values()), cases


def test_the_softmax_mixer_trains_on_the_fused_rope(interpreted):
    # a NaLaSoftmaxAttention on core='fused' (float32) against a float64 copy on its reference
    # core: the output, the input's and every parameter's gradient; under bf16 autocast the
    # same step as on core='fast', bit for bit
    assert interpreted['rope train NaLaSoftmaxAttention'] < 1e-5
    assert interpreted['rope bf16 mixer against core fast'] == 0


def _records(run):
    with TrafficCounter() as tc, PeakMemoryCounter(include_meta=True) as mem:
        run()
    return tc, mem.peak_bytes


def test_a_step_on_meta_is_one_launch_each_way_with_its_traffic():
    # q, a bf16 head view of the projection (rows 4C apart) -> the rotated q in bf16 (a
    # (B, N, h, d) buffer); backward: the bf16 gradient -> q's, in the same layout; the float32
    # (N, d / 2, 2) table of the angles read each time, nothing else
    B, h, N, d = 2, 3, 40, 16
    proj = torch.empty(B, N, 4 * h * d, device='meta', dtype=torch.bfloat16, requires_grad=True)
    q = proj[..., :h * d].unflatten(-1, (h, d)).transpose(1, 2)
    table = torch.empty(N, d // 2, 2, device='meta')

    def run():
        y = rf.RopeRotateFused.apply(q, table, torch.bfloat16)
        y.backward(torch.empty_like(y))

    tc, _ = _records(run)
    half = B * h * N * d * 2
    assert [r[:2] for r in tc.records if r[0] == 'rope_rotate'] == [
        ('rope_rotate', half + N * d * 4 + half)] * 2
    assert proj.grad.shape == proj.shape and proj.grad.dtype == torch.bfloat16


def test_a_softmax_stage_moves_fewer_bytes_with_the_fused_rope():
    # NaLaFormer-T's stage-3 softmax mixer at 800 x 1344 (batch 2, 50 x 84 tokens, C = 256,
    # 4 heads; bf16 autocast, meta, the attention as the fused kernel a GPU runs, as
    # tools/benchmark.py counts it), training step: the RoPE's casts and complex products
    # (about 20 bytes per element of q and k each way) become one 4-byte pass each way; fewer
    # operations, no higher peak
    fused_attention_on_meta = runpy.run_path(osp.join(REPO, 'tools', 'benchmark.py'),
                                             run_name='linattn_benchmark')[
                                                 'fused_attention_on_meta']
    m = NaLaSoftmaxAttention(256, 4).to('meta').train()
    x = torch.empty(2, 50 * 84, 256, device='meta', requires_grad=True)
    moved = {}
    for core in ('fast', 'fused'):
        m.core = core

        def run():
            with fused_attention_on_meta(), meta_autocast(torch.bfloat16):
                out = m(x, (50, 84))
            out.float().sum().backward()

        tc, peak = _records(run)
        moved[core] = (len(tc.records), tc.bytes_moved, peak)
        m.zero_grad(set_to_none=True)
        x.grad = None
    fast, fused = moved['fast'], moved['fused']
    saved = fast[1] - fused[1]
    elements = 2 * 50 * 84 * 256  # of q (and of k)
    assert fused[0] < fast[0], moved
    assert saved >= 2 * 2 * 14 * elements, moved  # q and k, each way
    assert fused[2] <= fast[2], moved


def test_the_attention_core_switch_takes_the_softmax_mixers_along(monkeypatch):
    # --attn-core fused puts the softmax mixers of the released stages 3-4 on core='fused' (the
    # fused RoPE; their attention stays torch's), any other core back on 'fast'; set_fused_rope
    # alone leaves a mixer on 'reference' there when switching off
    monkeypatch.setenv('TRITON_INTERPRET', '1')  # the device check: Triton may run here
    net = NaLaFormer(arch=dict(embed_dims=[16, 32, 32, 32], depths=[1, 1, 1, 1],
                               num_heads=[1, 2, 2, 2], mlp_ratios=[2, 2, 2, 2]))
    softmax = [m for m in net.modules() if isinstance(m, NaLaSoftmaxAttention)]
    assert len(softmax) == 2
    set_attention_core(net, 'fused')
    assert [m.core for m in softmax] == ['fused', 'fused']
    set_attention_core(net, 'fast')
    assert [m.core for m in softmax] == ['fast', 'fast']
    softmax[0].core = 'reference'
    assert set_fused_rope(net, False) == 0
    assert [m.core for m in softmax] == ['reference', 'fast']
    assert set_fused_rope(net, True) == 2


def test_a_float64_mixer_on_the_fused_core_is_the_torch_form():
    # float64 q and k take the torch rotation with float64 tables (no kernel), under autocast
    # too (which leaves float64 as it is): the same step as on core='fast', bit for bit, and the
    # stage's shared tables keep their float64 angles for the mixers on 'fast'
    torch.manual_seed(0)
    m = NaLaSoftmaxAttention(32, 2).double().train()
    x = torch.randn(2, 30 * 30, 32, dtype=torch.float64)
    shared = RoPE2d(16).double()((30, 30))
    for autocast in (False, True):
        runs = []
        for core in ('fast', 'fused', 'fast'):
            m.core = core
            m.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
                out = m(xi, (30, 30), shared)
            out.square().sum().backward()
            runs.append([out.detach(), xi.grad] + [p.grad for p in m.parameters()])
        for fused, fast_before, fast_after in zip(runs[1], runs[0], runs[2]):
            assert fused.dtype == torch.float64
            assert torch.equal(fused, fast_before) and torch.equal(fast_after, fast_before)


def test_the_table_compiles_into_one_graph():
    # under torch.compile the angles' table is made in the graph (the stage's cache of complex
    # tables is the eager form's): fullgraph compiles, the same table
    sin, cos = RoPE2d(16)((5, 6))
    shared = type(RoPE2d(16)((5, 6)))(sin, cos)
    compiled = torch.compile(rf.rope_table, fullgraph=True, backend='eager')
    assert torch.equal(compiled(sin, cos, shared), rf.rope_table(sin, cos, shared))


def test_other_inputs_take_the_torch_form_and_bad_ones_are_named(monkeypatch):
    # float64 and empty maps go through the torch rotation (the reference's numbers); the
    # Function names a wrong dtype, shape or device
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    sin, cos = RoPE2d(8)((3, 4))
    x = torch.randn(2, 2, 12, 8, dtype=torch.float64, requires_grad=True)
    got = rf.rope_rotate_fused(x, sin, cos, torch.float64)
    torch.testing.assert_close(got, apply_rope(x, sin.double(), cos.double()), rtol=0, atol=0)
    empty = rf.rope_rotate_fused(torch.randn(2, 2, 0, 8), sin[:0], cos[:0], torch.bfloat16)
    assert empty.shape == (2, 2, 0, 8) and empty.dtype == torch.bfloat16
    table = rf.rope_table(sin, cos)
    assert table.shape == (12, 4, 2) and torch.equal(table[..., 0], cos[:, ::2])
    assert torch.equal(table[..., 1], sin[:, ::2])
    with pytest.raises(RuntimeError, match='RopeRotateFused: x is on cpu; the kernel runs on '
                                           'CUDA'):
        rf.RopeRotateFused.apply(x.float(), table, torch.float32)
    monkeypatch.setenv('TRITON_INTERPRET', '1')
    with pytest.raises(TypeError, match='x must be float32, bfloat16 or float16, got '
                                        'torch.float64'):
        rf.RopeRotateFused.apply(x, table, torch.float64)
    with pytest.raises(ValueError, match=r'x must be \(B, h, N, d\) with an even d and the table '
                                         r'\(N, d / 2, 2\), got \(2, 2, 12, 8\) and \(12, 3, 2\)'):
        rf.RopeRotateFused.apply(x.float(), table[:, :3], torch.float32)
    with pytest.raises(TypeError, match='the table must be float32, got torch.float64'):
        rf.RopeRotateFused.apply(x.float(), table.double(), torch.float32)
    with pytest.raises(ValueError, match=r"NaLaSoftmaxAttention: core must be one of \('fast', "
                                         r"'reference', 'fused'\), got 'triton'"):
        NaLaSoftmaxAttention(32, 2, core='triton')
