"""The fused NaLa core (:mod:`linattn_mm.ops.nala.fused`: the torch core's products, its
elementwise passes with the RoPE as three Triton kernels) against a float64 implementation of the
official kernel written from the formulas. Without a GPU its kernels run in Triton's interpreter
on CPU tensors (a subprocess with ``TRITON_INTERPRET=1``,
``tests/kernels/triton_interpret_checks.py nala-fused``); on ``meta`` tensors its launches are one
operation each, with the bytes their kernels read and write."""
import pytest
import torch

import linattn_mm.ops.nala.fused as nf
from linattn_mm.models.attentions.nala import NormAwareLinearAttention, RoPE2d
from linattn_mm.ops.dispatch import fused_block, fused_chunks
from linattn_mm.ops.nala import nala_attention
from linattn_mm.utils import TrafficCounter
from harness import (NALA_NETWORK_FLOAT32_SHORTFALL, assert_nala_calls_in_situ,
                     assert_nala_core_grads, assert_nala_module_steps, assert_nala_network_step,
                     triton_interpret_checks)

pytestmark = pytest.mark.skipif(nf.triton is None, reason='Triton is not installed')

@pytest.fixture(scope='module')
def interpreted():
    return triton_interpret_checks('nala-fused')


def test_fused_core_and_its_gradients_equal_the_reference(interpreted):
    # eight cases (RoPE or none, lam 2 and 3, padded head dims 12 and 8, d = 64, several chunks,
    # strided queries, fp32 / bf16 / fp16): the output and the gradients of q, k, v against
    # plain autograd of the float64 reference on the same inputs
    assert_nala_core_grads(interpreted)


def test_fused_core_under_another_launch_equals_the_reference(interpreted):
    # dispatch.fused_launch (8 warps, tiles of 512 elements): the same output and gradients of
    # q, k, v as the float64 reference to float32 rounding, as with the default launch
    launch = {k: v for k, v in interpreted.items() if k.startswith('launch ')}
    assert sorted(launch) == [f'launch 8 warps, 512 elements: {t}' for t in ('k', 'out', 'q', 'v')]
    assert all(err < 1e-5 for err in launch.values()), launch


def test_fused_core_reads_the_half_precision_twin_of_v(interpreted):
    # v_keep (the projection under autocast): read and kept instead of v (the script checks it
    # is what the Function keeps), the same output and gradients to the bit
    assert interpreted['v_keep: largest difference to reading v (out, dq, dk, dv)'] == 0


def test_training_steps_on_the_fused_core_equal_the_reference(interpreted):
    # modules (with and without RoPE, lam 2) within 1e-5 of the float64 reference cores
    assert_nala_module_steps(interpreted)


@NALA_NETWORK_FLOAT32_SHORTFALL
def test_a_network_step_on_the_fused_core_is_as_accurate_as_on_the_torch_core(interpreted):
    # a whole NaLaFormer (NaLa in every stage, activation checkpointing) within 1.5x the float32
    # error of the same network on the default torch core
    assert_nala_network_step(interpreted)


def test_fused_core_in_the_network_is_as_accurate_as_the_torch_core(interpreted):
    # the same network step's four NaLa core calls, each on the inputs and the upstream gradient
    # it got in the float32 network: the fused core against the float64 oracle within 4e-6 at
    # every call, and over the calls no less accurate than the torch core and the float32
    # reference core (geometric mean error ratio <= 1.5): the kernels where the network uses
    # them, without the network's amplification of rounding
    assert_nala_calls_in_situ(interpreted, 'fused')


def test_fused_core_on_meta_is_six_launches_with_their_traffic():
    # a training step with the RoPE on meta tensors: the key and query features (forward), the
    # query features again and their gradients, the key features and their gradients (backward),
    # each one operation reading its inputs and writing its outputs once
    B, h, (H, W), d = 2, 3, (5, 8), 12
    N, DP = H * W, 16
    meta = dict(device='meta')
    q, k, v = (torch.empty(B, h, N, d, **meta, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    sin, cos = (t.to('meta') for t in RoPE2d(d)((H, W)))
    with TrafficCounter() as tc:
        out = nala_attention(q, k, v, 3., 1e-6, sin, cos, core='fused')
        out.backward(torch.empty_like(out))
    assert out.dtype == torch.bfloat16
    launches = [r[:2] for r in tc.records if r[0].startswith('nala_fused')]
    half, table = B * h * N * d * 2, N * d * 4  # bytes
    features = 4 * B * h * N * d * 4  # [f cos | f sin], float32
    den, means = B * h * N * 4, B * h * 2 * DP * 4
    chunks = fused_chunks(N, B * h, fused_block(d), torch.device('meta'))[0]
    key_features = half + 2 * table + features + chunks * means  # k, sin, cos -> F_k, partials
    query_features = half + means + 2 * table + features + den  # q, means, sin, cos -> F_q, den
    want = [('nala_fused_features', key_features),
            ('nala_fused_features', query_features),
            ('nala_fused_features', query_features),
            # q, means, sin, cos, dF_q, dden -> dq (bf16), partial sums of the means' gradient
            ('nala_fused_query_grads', half + means + 2 * table + features + den + half
             + chunks * means),
            ('nala_fused_features', key_features),
            # k, sin, cos, dF_k, d sums -> dk (bf16)
            ('nala_fused_key_grads', half + 2 * table + features + means + half)]
    assert launches == want
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


def test_a_nala_step_moves_fewer_bytes_on_the_fused_core():
    # a NaLa layer's training step at a stage-1 size of 800 x 1344, bf16 autocast, on meta: fewer
    # operations and under 0.6x the bytes of the torch core
    from linattn_mm.utils import meta_autocast
    m = NormAwareLinearAttention(64, 1).to('meta').train()
    x = torch.empty(2, 200 * 336, 64, device='meta')
    moved = {}
    for core in ('fast', 'fused'):
        m.core = core
        with TrafficCounter() as tc:
            with meta_autocast(torch.bfloat16):
                loss = m(x, (200, 336)).float().square().mean()
            loss.backward()
        moved[core] = (len(tc.records), tc.bytes_moved)
        m.zero_grad(set_to_none=True)
    assert moved['fused'][0] < moved['fast'][0], moved
    assert moved['fused'][1] < 0.6 * moved['fast'][1], moved


def test_bad_inputs_and_devices_are_named(monkeypatch):
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    q = torch.randn(1, 2, 16, 8)
    sin, cos = RoPE2d(8)((4, 4))
    with pytest.raises(TypeError, match='nala_attention_fused: q has dtype torch.float64'):
        nf.nala_attention_fused(q.double(), q.double(), q.double())
    with pytest.raises(RuntimeError, match='q is on cpu; the kernel runs on CUDA'):
        nf.nala_attention_fused(q, q, q)
    with pytest.raises(ValueError, match='power must be positive'):
        nf.nala_attention_fused(q, q, q, power=0.)
    with pytest.raises(ValueError, match='both sin and cos'):
        nf.nala_attention_fused(q, q, q, sin=sin)
    with pytest.raises(ValueError, match='keys on the query grid'):
        nf.nala_attention_fused(q, q[:, :, :9], q[:, :, :9], sin=sin, cos=cos)
    with pytest.raises(ValueError, match='head dim 7 is odd'):
        nf.nala_attention_fused(q[..., :7], q[..., :7], q[..., :7], sin=sin[:, :7],
                                cos=cos[:, :7])
    with pytest.raises(ValueError, match="kernel='paper' has no fused core"):
        nala_attention(q, q, q, kernel='paper', core='fused')
