"""How the Pola and NaLa mixers choose their Triton cores: never for CPU tensors on the automatic
path, and after a failing automatic call (compiler, driver) a warning, the torch kernel's result
and no second try in the process; ``fused='triton'`` raises the error instead."""
import pytest
import torch

from linattn_mm.models.attentions.nala import NormAwareLinearAttention
from linattn_mm.models.attentions.pola import PolaLinearAttention

#: family -> (a small mixer, the Triton core it calls)
MIXERS = {
    'pola': (lambda: PolaLinearAttention(16, 2, pretrain_hw=(4, 4)),
             'linattn_mm.ops.pola_triton.polarity_attention_triton'),
    'nala': (lambda: NormAwareLinearAttention(16, 2),
             'linattn_mm.ops.nala_triton.nala_attention_triton'),
}


@pytest.mark.parametrize('family', sorted(MIXERS))
def test_automatic_selection_keeps_cpu_on_the_torch_kernel(monkeypatch, family):
    make, core = MIXERS[family]

    def boom(*a, **k):
        raise AssertionError('the Triton core must not run on CPU tensors')
    monkeypatch.setattr(core, boom)
    m = make().eval()
    with torch.no_grad():
        assert m(torch.randn(1, 16, 16), (4, 4)).shape == (1, 16, 16)


@pytest.mark.parametrize('family', sorted(MIXERS))
def test_automatic_triton_failure_falls_back_to_the_torch_kernel(monkeypatch, family):
    make, core = MIXERS[family]
    calls, failures = [], []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError('PTX assembly failed')
    monkeypatch.setattr(core, broken)
    monkeypatch.setattr('linattn_mm.ops.common.TRITON_FAILURE', failures)
    torch.manual_seed(0)
    m = make().eval()
    # CPU stand-in for "CUDA inference": select Triton whenever no failure has been seen
    monkeypatch.setattr(type(m), '_use_triton', lambda self, q, k, v: self.fused == 'triton' or
                        (self.fused is None and not failures))
    if hasattr(type(m), '_use_chunked_layer'):  # Pola's whole-layer CPU form: not on CUDA
        monkeypatch.setattr(type(m), '_use_chunked_layer', lambda self, x: False)
    x = torch.randn(1, 16, 16)
    with torch.no_grad():
        with pytest.warns(UserWarning, match='Triton kernel failed .RuntimeError: PTX assembly '
                          'failed.; the torch kernel runs instead'):
            got = m(x, (4, 4))
        again = m(x, (4, 4))
        m.fused = False
        want = m(x, (4, 4))
        assert len(calls) == 1 and len(failures) == 1 and torch.equal(got, again)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
        m.fused = 'triton'
        with pytest.raises(RuntimeError, match='PTX assembly failed'):
            m(x, (4, 4))
