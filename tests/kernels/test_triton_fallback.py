"""How the Pola and NaLa mixers come to run their Triton cores: never on CPU (neither the default
core nor the CPU conversion calls them), through :func:`linattn_mm.deploy.convert` for CUDA, and
after a failing call of a converted mixer (compiler, driver) a warning, the torch kernel's result
and no second try; ``core='triton'`` set on an unconverted mixer raises the error instead."""
import pytest
import torch

from linattn_mm import deploy
from linattn_mm.models.attentions.nala import NormAwareLinearAttention
from linattn_mm.models.attentions.pola import PolaLinearAttention

#: family -> (a small mixer, the Triton core it calls)
MIXERS = {
    'pola': (lambda: PolaLinearAttention(16, 2, pretrain_hw=(4, 4)),
             'linattn_mm.ops.pola.triton.polarity_attention_triton'),
    'nala': (lambda: NormAwareLinearAttention(16, 2),
             'linattn_mm.ops.nala.triton.nala_attention_triton'),
}


@pytest.mark.parametrize('family', sorted(MIXERS))
def test_cpu_never_runs_the_triton_core(monkeypatch, family):
    make, core = MIXERS[family]

    def boom(*a, **k):
        raise AssertionError('the Triton core must not run on CPU tensors')
    monkeypatch.setattr(core, boom)
    m = make().eval()
    with torch.no_grad():
        assert m(torch.randn(1, 16, 16), (4, 4)).shape == (1, 16, 16)  # core='fast'
        deploy.convert(m)  # the CPU form
        assert m.core == 'fast' and isinstance(m, deploy.InferenceForm)
        assert m(torch.randn(1, 16, 16), (4, 4)).shape == (1, 16, 16)


@pytest.mark.parametrize('family', sorted(MIXERS))
def test_converted_triton_failure_falls_back_to_the_torch_kernel(monkeypatch, family):
    make, core = MIXERS[family]
    calls, failures = [], []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError('PTX assembly failed')
    monkeypatch.setattr(core, broken)
    monkeypatch.setattr('linattn_mm.ops.dispatch.TRITON_FAILURES', failures)
    # CPU stand-in for a CUDA device: Triton's interpreter lets the CUDA forms take CPU tensors
    monkeypatch.setenv('TRITON_INTERPRET', '1')
    torch.manual_seed(0)
    m = make().eval()
    deploy.convert(m, 'cuda')
    assert m.core == 'triton' and type(m).__name__.endswith('Triton')
    x = torch.randn(1, 16, 16)
    with torch.no_grad():
        with pytest.warns(UserWarning, match='Triton kernel failed .RuntimeError: PTX assembly '
                          'failed.; the torch kernel runs instead'):
            got = m(x, (4, 4))
        again = m(x, (4, 4))
        deploy.revert(m)
        assert m.core == 'fast'  # the core it had before the conversion
        m.core = 'reference'
        want = m(x, (4, 4))
        assert len(calls) == 1 and len(failures) == 1 and torch.equal(got, again)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
        m.core = 'triton'
        with pytest.raises(RuntimeError, match='PTX assembly failed'):
            m(x, (4, 4))
