"""The Triton core of Pola attention (:mod:`linattn_mm.ops.pola.triton`) against the float64
reference core (official order of operations). Without a GPU the kernels run in
Triton's interpreter on CPU tensors (a subprocess with ``TRITON_INTERPRET=1``, see
``tests/kernels/triton_interpret_checks.py``): the same kernel code, launch grid, masks and key-chunk
reduction as on CUDA. On a machine with CUDA the kernels are also compiled and checked, and the
CUDA conversion (:func:`linattn_mm.deploy.convert`) is checked to run them in inference."""
import pytest
import torch

import linattn_mm.ops.pola.triton as pt
from linattn_mm import deploy
from linattn_mm.models.attentions.pola import PolaLinearAttention
from linattn_mm.ops.dispatch import _interpreting
from linattn_mm.ops.pola.reference import polarity_attention_reference as polarity_attention
from harness import record_calls, triton_interpret_checks

pytestmark = pytest.mark.skipif(pt.triton is None, reason='Triton is not installed')


@pytest.fixture(scope='module')
def interpreted():
    return triton_interpret_checks('pola')


def test_interpreted_kernel_equals_the_reference(interpreted):
    # fp32 inputs: float rounding only (exp2/log2 for the power, float32 sums)
    core = {k: v for k, v in interpreted.items() if not k.startswith(('module', 'Pola-Swin'))}
    assert len(core) == 6
    for name, err in core.items():
        assert err < 1e-5, f'{name}: relative error {err:.3g}'


def test_interpreted_modules_and_backbone_equal_the_reference(interpreted):
    mods = {k: v for k, v in interpreted.items() if k.startswith(('module', 'Pola-Swin'))}
    assert set(mods) == {'module qkvg', 'module qg_kv la_sr 2', 'module static gate, class token',
                         'module polarity only', 'Pola-Swin backbone'}
    for name, err in mods.items():
        assert err < 1e-5, f'{name}: relative error {err:.3g}'


@pytest.fixture(scope='module')
def interpreted_grads():
    return triton_interpret_checks('pola-grad')


#: largest relative error (max |got - want| / max |want|) of a gradient stored in each dtype:
#: float32 arithmetic, or the rounding of the stored result (Triton's interpreter converts float32
#: to bfloat16 by truncation, one unit in the last place; compiled kernels round to nearest)
GRAD_TOL = {'q': 1e-5, 'k': 1e-5, 'v': 1e-5, 'pe': 1e-5, 'p': 1e-5, 'temperature': 1e-5,
            'out': 1e-5}
HALF_TOL = {'bf16': 2 ** -7 + 1e-5, 'fp16': 2 ** -11 + 1e-5}


def test_interpreted_backward_equals_the_reference(interpreted_grads):
    # the core's output and the gradient of every input against plain autograd of the float64
    # reference on the same (rounded) inputs
    core = {k: v for k, v in interpreted_grads.items() if k.startswith('grad ')}
    assert len(core) == 40  # 6 cases: the output and 5 or 6 inputs each
    for name, err in core.items():
        tensor = name.rsplit(': ', 1)[1]
        half = next((t for t in HALF_TOL if f' {t} ' in name), None)
        tol = HALF_TOL[half] if half and tensor in ('q', 'k', 'v', 'pe') else GRAD_TOL[tensor]
        assert err < tol, f'{name}: relative error {err:.3g}'


def test_interpreted_training_steps_equal_the_reference(interpreted_grads):
    # modules (both layouts, la_sr_ratio 2, a class token, the static gate, no gate / conv term)
    # and a Pola-Swin backbone with activation checkpointing: the output, the input's gradient
    # and every parameter's gradient, float32 Triton against the float64 reference cores
    steps = {k: v for k, v in interpreted_grads.items() if k.startswith('train ')}
    assert len(steps) == 5
    for name, err in steps.items():
        assert err < 1e-5, f'{name}: relative error {err:.3g}'


def test_bad_inputs_are_named():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r'k and v must be \(B, h, n, d\)'):
        pt.polarity_attention_triton(q, torch.randn(1, 2, 8, 5), q, torch.ones(1, 2, 1, 4))
    with pytest.raises(TypeError, match='float64'):
        pt.polarity_attention_triton(q.double(), q.double(), q.double(), torch.ones(1, 2, 1, 4))
    if not _interpreting():
        with pytest.raises(RuntimeError, match='runs on CUDA tensors'):
            pt.polarity_attention_triton(q, q, q, torch.ones(1, 2, 1, 4))
    with pytest.raises(ValueError, match="core must be one of"):
        PolaLinearAttention(16, 2, pretrain_hw=(4, 4), core='auto')
    if not _interpreting():
        m = PolaLinearAttention(16, 2, pretrain_hw=(4, 4), core='triton')
        with pytest.raises(RuntimeError, match='runs on CUDA tensors'):
            m(torch.randn(1, 16, 16), (4, 4))  # training on CPU tensors


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_cuda_kernel_is_selected_and_matches(monkeypatch, dtype):
    real = pt.polarity_attention_triton  # called directly below, not counted
    calls = record_calls(monkeypatch, pt, 'polarity_attention_triton')
    B, h, N, d = 2, 3, 4096, 32
    g = torch.Generator(device='cuda').manual_seed(0)
    q, k, v = (torch.randn(B, h, N, d, device='cuda', generator=g).to(dtype) for _ in range(3))
    p = 1 + 4 * torch.rand(1, h, 1, d, device='cuda', generator=g)
    got = real(q, k, v, p, out_dtype=torch.float32)
    want = polarity_attention(q.double(), k.double(), v.double(), p.double(), 1e-6)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    m = PolaLinearAttention(h * d, h, pretrain_hw=(64, 64)).cuda().eval()
    x = torch.randn(B, N, h * d, device='cuda', generator=g)
    with torch.no_grad():
        fast = deploy.convert(m)(x, (64, 64))
        deploy.revert(m).core = 'reference'
        ref = m(x, (64, 64))
    assert calls and ((fast - ref).abs().max() / ref.abs().max()).item() < 1e-5
