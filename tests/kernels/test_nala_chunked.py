"""The chunked inference form of the whole NaLa layer (:func:`linattn_mm.ops.nala.chunked_cpu.
nala_layer_chunked`, the CPU form :func:`linattn_mm.deploy.convert` gives
``NormAwareLinearAttention``) against the reference layer (``core='reference'``: feature maps, RoPE
and gate in the official order of operations), and which mixers get it."""
import pytest
import torch
from harness import assert_inference_only, record_calls

import linattn_mm.deploy.mixers as deploy_mixers
import linattn_mm.ops.nala.chunked_cpu as nala_ops
from linattn_mm import deploy
from linattn_mm.models.attentions.nala import NormAwareLinearAttention, RoPE2d
from linattn_mm.ops.nala.chunked_cpu import nala_layer_chunked

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
CASES = [dict(), dict(use_rope=False), dict(power=2.), dict(qkv_bias=False, heads=1),
         dict(heads=4)]


def pair(case, dtype, dims=32):
    case = dict(case)
    heads = case.pop('heads', 2)
    torch.manual_seed(0)
    fast = NormAwareLinearAttention(dims, heads, **case)
    ref = NormAwareLinearAttention(dims, heads, core='reference', **case)
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(0.2 * torch.randn_like(p))
    ref.load_state_dict(fast.state_dict())
    return deploy.convert(fast.to(dtype).eval()), ref.to(dtype).eval()


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture
def chunked_calls(monkeypatch):
    return record_calls(monkeypatch, deploy_mixers, 'nala_layer_chunked')


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('case', CASES)
@pytest.mark.parametrize('rows', [5, 17, 10_000])
def test_layer_equals_reference(case, dtype, rows, monkeypatch, chunked_calls):
    monkeypatch.setattr(nala_ops, 'LAYER_CHUNK_ROWS', rows)
    fast, ref = pair(case, dtype)
    x = torch.randn(2, 6 * 7, 32, dtype=dtype)
    with torch.no_grad():
        err = rel_err(fast(x, (6, 7)), ref(x, (6, 7)))
    assert err < TOL[dtype], err
    assert chunked_calls == [(2, 42, 32)]


def test_layer_with_a_shared_rope_equals_reference(chunked_calls):
    """The native hierarchy passes one (sin, cos) per stage."""
    fast, ref = pair({}, torch.float64)
    rope = RoPE2d(16).double()((5, 8))
    x = torch.randn(1, 40, 32, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(fast(x, (5, 8), rope=rope), ref(x, (5, 8), rope=rope)) < 1e-10
    assert len(chunked_calls) == 1


def test_converted_only_where_the_form_applies(chunked_calls):
    x = torch.randn(1, 20, 32)
    fast, _ = pair({}, torch.float32)
    with torch.no_grad():
        fast(x, (4, 5))
    assert len(chunked_calls) == 1
    # gradients, training mode, autocast: refused with the reason
    assert_inference_only(fast, lambda: fast(x, (4, 5)), lambda: fast(x, (4, 5)))
    with torch.no_grad():
        deploy.revert(fast).core = 'reference'
        fast(x, (4, 5))
        fast.core = 'triton'
        with pytest.raises(RuntimeError):  # no Triton run on CPU tensors
            fast(x, (4, 5))
        fast.core = 'fast'
        paper, _ = pair(dict(kernel='paper'), torch.float32)
        assert type(paper) is NormAwareLinearAttention  # no chunked form: left as it is
        paper(x, (4, 5))
    assert len(chunked_calls) == 1
    deploy.convert(fast)
    for p in fast.parameters():
        p.requires_grad_(False)
    fast(x, (4, 5))
    assert len(chunked_calls) == 2


def test_kernel_rejects_what_it_cannot_do():
    x = torch.randn(1, 6, 6)
    w = torch.randn(6, 6)
    args = (w, None, torch.randn(12, 6), None, w, None, lambda v: v, None, None, 1e-5, w, None,
            3., 1e-6, None, None)
    with pytest.raises(ValueError, match='in 4 heads do not give a whole head dim'):
        nala_layer_chunked(x, *args, 4)
    with pytest.raises(ValueError, match='rows must be positive'):
        nala_layer_chunked(x, *args, 2, rows=-2)
    with pytest.raises(RuntimeError, match='forward-only'):
        nala_layer_chunked(x.requires_grad_(), *args, 2)
