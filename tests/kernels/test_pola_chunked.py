"""The chunked inference form of the whole Pola layer (:func:`linattn_mm.ops.pola.chunked_cpu.
polarity_layer_chunked`, the CPU form :func:`linattn_mm.deploy.convert` gives
``PolaLinearAttention``) against the reference layer (``core='reference'``: the official order of
operations), and which mixers get it."""
import pytest
import torch
from harness import assert_inference_only, record_calls

import linattn_mm.deploy.mixers as deploy_mixers
import linattn_mm.ops.pola.chunked_cpu as chunked_ops
from linattn_mm import deploy
from linattn_mm.models.attentions.pola import PolaLinearAttention
from linattn_mm.ops.pola.chunked_cpu import polarity_layer_chunked
from test_fast_paths import assert_rel, randomise_

CASES = [
    dict(qkv_layout='qkvg'),
    dict(qkv_layout='qg_kv'),
    dict(qkv_layout='qkvg', use_pos_enc=False, temperature=False),
    dict(qkv_layout='qg_kv', qkv_bias=False),
    dict(qkv_layout='qg_kv', heads=1, dims=16),
    dict(qkv_layout='qkvg', use_dwc=False),  # no conv term
]


def pair(case, dtype, convert=True):
    case = dict(case)
    dims, heads = case.pop('dims', 24), case.pop('heads', 3)
    torch.manual_seed(0)
    kw = dict(pretrain_hw=(4, 4)) if case.get('use_pos_enc', True) else {}
    fast = PolaLinearAttention(dims, heads, **kw, **case)
    ref = PolaLinearAttention(dims, heads, core='reference', **kw, **case)
    randomise_(fast)
    ref.load_state_dict(fast.state_dict())
    fast = fast.to(dtype).eval()
    return deploy.convert(fast) if convert else fast, ref.to(dtype).eval()


@pytest.fixture
def chunked_calls(monkeypatch):
    return record_calls(monkeypatch, deploy_mixers, 'polarity_layer_chunked')


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('case', CASES)
@pytest.mark.parametrize('rows', [4, 13, 10_000])  # remainders, one chunk per image
def test_layer_equals_reference(case, dtype, rows, monkeypatch, chunked_calls):
    monkeypatch.setattr(chunked_ops, 'LAYER_CHUNK_ROWS', rows)
    fast, ref = pair(case, dtype)
    hw = (5, 7)  # not the pretraining grid: the position encoding is resized
    x = torch.randn(2, 35, fast.embed_dims, dtype=dtype)
    with torch.no_grad():
        want = ref(x, hw)
        got = fast(x, hw)
        assert_rel(got, want, dtype)
        assert_rel(fast(x, hw), want, dtype)  # cached coefficients / PE
    assert chunked_calls == [(2, 35, fast.embed_dims)] * 2


@pytest.mark.parametrize('case', CASES[:2])
def test_unchunked_inference_path_still_equals_reference(case, chunked_calls):
    """The fast kernel's own forward form (the unconverted mixer in inference, e.g. on CUDA
    without Triton, and the layers the chunked form does not cover) keeps its coverage for the
    eligible layouts too."""
    fast, ref = pair(case, torch.float64, convert=False)
    x = torch.randn(2, 35, 24, dtype=torch.float64)
    with torch.no_grad():
        assert_rel(fast(x, (5, 7)), ref(x, (5, 7)), torch.float64)
    assert chunked_calls == []


def test_converted_only_where_the_form_applies(chunked_calls):
    x = torch.randn(1, 20, 24)
    fast, _ = pair(CASES[0], torch.float32)
    with torch.no_grad():
        fast(x, (4, 5))
    assert len(chunked_calls) == 1
    # gradients, training mode, autocast: refused with the reason
    assert_inference_only(fast, lambda: fast(x, (4, 5)), lambda: fast(x, (4, 5)))
    with torch.no_grad(), pytest.raises(RuntimeError, match='float32 / float64 inputs'):
        fast.half()(x.half(), (4, 5))  # only float32 / float64
    others = [dict(qkv_layout='qkvg', gate='static'), dict(qkv_layout='qg_kv', gate='none'),
              dict(qkv_layout='qg_kv', gate='none', use_dwc=False),  # polarity only
              dict(qkv_layout='qg_kv', la_sr_ratio=2), dict(qkv_layout='qkvg', num_extra_tokens=1),
              dict(qkv_layout='qkvg', heads=8)]  # head dim 3: odd
    for case in others:
        m, _ = pair(case, torch.float32)
        assert type(m) is PolaLinearAttention, case  # no chunked form: left as it is
        e = case.get('num_extra_tokens', 0)
        with torch.no_grad():
            m(torch.randn(1, e + 36, 24), (6, 6))
    assert len(chunked_calls) == 1
    for p in fast.float().parameters():  # frozen: inference even with autograd on
        p.requires_grad_(False)
    fast(x, (4, 5))
    assert len(chunked_calls) == 2


def test_kernel_rejects_what_it_cannot_do():
    x = torch.randn(1, 6, 6)
    w = torch.randn(6, 6)
    args = (w, None, torch.randn(12, 6), None, w, None, w, None, torch.ones(6), None, None, 1e-6)
    conv = lambda v: v  # noqa: E731
    with pytest.raises(ValueError, match='even head dim'):
        polarity_layer_chunked(x, *args, 2, conv)
    with pytest.raises(ValueError, match='rows must be positive'):
        polarity_layer_chunked(x, *args, 3, conv, rows=-1)
    with pytest.raises(RuntimeError, match='forward-only'):
        polarity_layer_chunked(x.requires_grad_(), *args, 3, conv)


def test_default_chunk_follows_the_width():
    """Without a chunk size the chunked layers take ``elements // C`` tokens (at least 256, at
    most the tokens there are); a module-level or explicit size wins."""
    from linattn_mm.ops.common import chunked_layer_setup
    x = lambda N, C: torch.zeros(1, N, C)  # noqa: E731
    assert chunked_layer_setup('t', x(5000, 64), 1, None, None, 2 ** 16, False)[-1] == 1024
    assert chunked_layer_setup('t', x(5000, 128), 2, None, None, 2 ** 17, True)[-1] == 1024
    assert chunked_layer_setup('t', x(5000, 512), 8, None, None, 2 ** 16, True)[-1] == 256
    assert chunked_layer_setup('t', x(100, 64), 1, None, None, 2 ** 16, False)[-1] == 100
    assert chunked_layer_setup('t', x(5000, 64), 1, None, 300, 2 ** 16, False)[-1] == 300
    assert chunked_layer_setup('t', x(5000, 64), 1, 7, 300, 2 ** 16, False)[-1] == 7
