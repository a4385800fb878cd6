"""The Triton core of NaLa attention (:mod:`linattn_mm.ops.nala.triton`) against a float64
implementation of the official kernel written from the formulas (d(q)^p with the norm-dependent
power, k^lam, sign split, unrotated normaliser, 2-D RoPE on the numerator). Without a GPU the
kernels run in Triton's interpreter on CPU tensors (a subprocess with ``TRITON_INTERPRET=1``, see
``tests/kernels/triton_interpret_checks.py``); with CUDA they are also compiled, checked and checked to
run in the model converted for CUDA (:func:`linattn_mm.deploy.convert`)."""
import pytest
import torch

import linattn_mm.ops.nala.triton as nt
from linattn_mm import deploy
from linattn_mm.models.attentions.nala import NormAwareLinearAttention, RoPE2d
from linattn_mm.ops.dispatch import _interpreting, triton_available
from oracles.nala import nala_reference_core
from harness import (NALA_NETWORK_FLOAT32_SHORTFALL, assert_nala_calls_in_situ,
                     assert_nala_core_grads, assert_nala_module_steps, assert_nala_network_step,
                     record_calls, triton_interpret_checks)

pytestmark = pytest.mark.skipif(nt.triton is None, reason='Triton is not installed')


@pytest.fixture(scope='module')
def interpreted():
    return triton_interpret_checks('nala')


def test_interpreted_kernel_equals_the_reference(interpreted):
    core = {k: v for k, v in interpreted.items() if 'module' not in k and 'backbone' not in k}
    # RoPE / no RoPE, padded head dim (12 -> 16), d = 64, lam != 3, several key chunks, bf16
    # and fp16
    assert len(core) == 8
    for name, err in core.items():
        assert err < 1e-5, f'{name}: relative error {err:.3g}'


def test_interpreted_modules_and_backbone_equal_the_reference(interpreted):
    mods = {k: v for k, v in interpreted.items() if 'module' in k or 'backbone' in k}
    assert set(mods) == {'nala module rope', 'nala module no rope, lam 2', 'NaLaFormer backbone'}
    for name, err in mods.items():
        assert err < 1e-5, f'{name}: relative error {err:.3g}'


def test_bad_inputs_are_named():
    q = torch.randn(1, 2, 16, 8)
    sin, cos = RoPE2d(8)((4, 4))
    with pytest.raises(ValueError, match=r'k and v must be \(B, h, n, d\)'):
        nt.nala_attention_triton(q, torch.randn(1, 2, 16, 4), q)
    with pytest.raises(TypeError, match='float64'):
        nt.nala_attention_triton(q.double(), q.double(), q.double())
    if not triton_available(q):
        with pytest.raises(RuntimeError, match='runs on CUDA tensors'):
            nt.nala_attention_triton(q, q, q)
    with pytest.raises(ValueError, match='power must be positive'):
        nt.nala_attention_triton(q, q, q, power=0.)
    with pytest.raises(ValueError, match='both sin and cos'):
        nt.nala_attention_triton(q, q, q, sin=sin)
    with pytest.raises(ValueError, match=r'sin/cos of shape \(N, d\) = \(16, 8\)'):
        nt.nala_attention_triton(q, q, q, sin=sin[:9], cos=cos[:9])
    with pytest.raises(ValueError, match='keys on the query grid'):
        nt.nala_attention_triton(q, q[:, :, :9], q[:, :, :9], sin=sin, cos=cos)


@pytest.fixture(scope='module')
def interpreted_grads():
    return triton_interpret_checks('nala-grad')


def test_interpreted_backward_equals_the_reference(interpreted_grads):
    # the core's output and the gradients of q, k, v against plain autograd of the float64
    # reference on the same (rounded) inputs: RoPE or none, lam 2 and 3, padded head dims,
    # several key chunks, strided queries, fp32 / bf16 / fp16 (bf16 / fp16 gradients within
    # their rounding, everything else 1e-5)
    assert_nala_core_grads(interpreted_grads)


def test_interpreted_core_reads_the_half_precision_twin_of_v(interpreted_grads):
    # v_keep (the projection under autocast, v its float32 copy): read and kept instead of v,
    # the same output and gradients to the bit, v's gradient in float32
    assert interpreted_grads['v_keep: largest difference to reading v (out, dq, dk, dv)'] == 0


def test_interpreted_training_steps_equal_the_reference(interpreted_grads):
    # modules (with and without RoPE, lam 2) within 1e-5 of the float64 reference cores: the
    # output, the input's and every parameter's gradient
    assert_nala_module_steps(interpreted_grads)


@NALA_NETWORK_FLOAT32_SHORTFALL
def test_interpreted_network_step_is_as_accurate_as_the_torch_core(interpreted_grads):
    # a whole NaLaFormer (NaLa in every stage, activation checkpointing) within 1.5x the float32
    # error of the same network on the default torch core (about 1.1e-5: LayerNorm and bias
    # gradients summed over the tokens)
    assert_nala_network_step(interpreted_grads)


def test_interpreted_core_in_the_network_is_as_accurate_as_the_torch_core(interpreted_grads):
    # the same network step's four NaLa core calls, each on the inputs and the upstream gradient
    # it got in the float32 network: the Triton core against the float64 oracle within 4e-6 at
    # every call, and over the calls no less accurate than the torch core and the float32
    # reference core (geometric mean error ratio <= 1.5): the kernels where the network uses
    # them, without the network's amplification of rounding
    assert_nala_calls_in_situ(interpreted_grads, 'triton')


def test_module_options_are_checked():
    with pytest.raises(ValueError, match="core must be one of"):
        NormAwareLinearAttention(16, 2, core='auto')
    with pytest.raises(ValueError, match="kernel='paper' has no Triton core"):
        NormAwareLinearAttention(16, 2, kernel='paper', core='triton')
    if not _interpreting():
        m = NormAwareLinearAttention(16, 2, core='triton')
        with pytest.raises(RuntimeError, match='runs on CUDA tensors'):
            m(torch.randn(1, 16, 16), (4, 4))  # training on CPU tensors


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_cuda_kernel_is_selected_and_matches(monkeypatch, dtype):
    real = nt.nala_attention_triton  # called directly below, not counted
    calls = record_calls(monkeypatch, nt, 'nala_attention_triton')
    B, h, (H, W), d = 2, 2, (64, 64), 32
    g = torch.Generator(device='cuda').manual_seed(0)
    q, k, v = (torch.randn(B, h, H * W, d, device='cuda', generator=g).to(dtype)
               for _ in range(3))
    sin, cos = RoPE2d(d).cuda()((H, W))
    got = real(q, k, v, 3., 1e-6, sin, cos, out_dtype=torch.float32)
    want = nala_reference_core(q.double(), k.double(), v.double(), 3., 1e-6,
                               (sin.double(), cos.double()))
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    m = NormAwareLinearAttention(h * d, h).cuda().eval()
    x = torch.randn(B, H * W, h * d, device='cuda', generator=g)
    with torch.no_grad():
        fast = deploy.convert(m)(x, (H, W))
        deploy.revert(m).core = 'reference'
        ref = m(x, (H, W))
    assert calls and ((fast - ref).abs().max() / ref.abs().max()).item() < 1e-5
