"""The Triton core of NaLa attention (:mod:`linattn_mm.ops.nala_triton`) against a float64
implementation of the official kernel written from the formulas (d(q)^p with the norm-dependent
power, k^lam, sign split, unrotated normaliser, 2-D RoPE on the numerator). Without a GPU the
kernels run in Triton's interpreter on CPU tensors (a subprocess with ``TRITON_INTERPRET=1``, see
``tests/triton_interpret_checks.py``); with CUDA they are also compiled, checked and checked to be
selected automatically in inference."""
import json
import os
import subprocess
import sys

import pytest
import torch

import linattn_mm.ops.nala_triton as nt
from linattn_mm.models.attentions.nala import NormAwareLinearAttention, RoPE2d

pytestmark = pytest.mark.skipif(nt.triton is None, reason='Triton is not installed')
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope='module')
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONWARNINGS='ignore')
    out = subprocess.run([sys.executable, os.path.join(HERE, 'triton_interpret_checks.py'),
                          'nala'], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(HERE))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_interpreted_kernel_equals_the_reference(interpreted):
    core = {k: v for k, v in interpreted.items() if 'module' not in k and 'backbone' not in k}
    # RoPE / no RoPE, padded head dim (12 -> 16), lam != 3, several key chunks, bf16 and fp16
    assert len(core) == 7
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
    if not nt.triton_available(q):
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


def test_module_options_are_checked():
    with pytest.raises(ValueError, match="fused must be None, True, False or 'triton'"):
        NormAwareLinearAttention(16, 2, fused='fast')
    with pytest.raises(ValueError, match="kernel='paper' has no Triton core"):
        NormAwareLinearAttention(16, 2, kernel='paper', fused='triton')
    m = NormAwareLinearAttention(16, 2, fused='triton')
    with pytest.raises(RuntimeError, match='forward-only'):
        m(torch.randn(1, 16, 16), (4, 4))  # training: a gradient is needed


def test_automatic_selection_keeps_cpu_on_the_torch_kernel(monkeypatch):
    def boom(*a, **k):
        raise AssertionError('the Triton core must not run on CPU tensors')
    monkeypatch.setattr(nt, 'nala_attention_triton', boom)
    m = NormAwareLinearAttention(16, 2).eval()
    with torch.no_grad():
        assert m(torch.randn(1, 16, 16), (4, 4)).shape == (1, 16, 16)


def test_automatic_triton_failure_falls_back_to_the_torch_kernel(monkeypatch):
    """A failing automatic Triton call warns once and the torch kernel gives the result for the
    rest of the process; fused='triton' raises the error."""
    import linattn_mm.models.attentions.nala as nala_mod
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError('PTX assembly failed')
    failures = []
    monkeypatch.setattr(nt, 'nala_attention_triton', broken)
    monkeypatch.setattr(nala_mod, 'TRITON_FAILURE', failures)
    monkeypatch.setattr('linattn_mm.ops.common.TRITON_FAILURE', failures)
    # CPU stand-in for "CUDA inference": select Triton whenever no failure has been seen
    monkeypatch.setattr(NormAwareLinearAttention, '_use_triton', lambda self, q, k, v:
                        self.fused == 'triton' or (self.fused is None and not failures))
    torch.manual_seed(0)
    m = NormAwareLinearAttention(16, 2).eval()
    x = torch.randn(1, 16, 16)
    with torch.no_grad():
        with pytest.warns(UserWarning, match='Triton kernel failed .RuntimeError: PTX assembly '
                          'failed.; the torch kernel runs instead'):
            got = m(x, (4, 4))
        again = m(x, (4, 4))
        m.fused = False
        want = m(x, (4, 4))
        assert len(calls) == 1 and torch.equal(got, again)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
        m.fused = 'triton'
        with pytest.raises(RuntimeError, match='PTX assembly failed'):
            m(x, (4, 4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_cuda_kernel_is_selected_and_matches(monkeypatch, dtype):
    from triton_interpret_checks import nala_reference
    calls = []
    real = nt.nala_attention_triton

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(nt, 'nala_attention_triton', spy)
    B, h, (H, W), d = 2, 2, (64, 64), 32
    g = torch.Generator(device='cuda').manual_seed(0)
    q, k, v = (torch.randn(B, h, H * W, d, device='cuda', generator=g).to(dtype)
               for _ in range(3))
    sin, cos = RoPE2d(d).cuda()((H, W))
    got = real(q, k, v, 3., 1e-6, sin, cos, out_dtype=torch.float32)
    want = nala_reference(q, k, v, 3., 1e-6, sin, cos)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    m = NormAwareLinearAttention(h * d, h).cuda().eval()
    x = torch.randn(B, H * W, h * d, device='cuda', generator=g)
    with torch.no_grad():
        fast = m(x, (H, W))
        m.fused = False
        ref = m(x, (H, W))
    assert calls and ((fast - ref).abs().max() / ref.abs().max()).item() < 1e-5
