"""``ops.lean_layers.ScaledAdd``: ``x + b * f`` with a small broadcast factor ``f`` (a layer scale,
a dropped sample's mask), its gradients equal to plain autograd of the product and the sum, and
what its backward moves."""
import pytest
import torch

from linattn_mm.ops import lean_layers
from linattn_mm.ops.lean_layers import ScaledAdd, _sum_of_products, scaled_add
from linattn_mm.utils import TrafficCounter, meta_autocast

CASES = [  # (name, map shape, factor shape)
    ('NCHW, per sample and channel', (3, 4, 5, 6), (3, 4, 1, 1)),
    ('NCHW, layer scale', (3, 4, 5, 6), (1, 4, 1, 1)),
    ('NCHW, per sample', (3, 4, 5, 6), (3, 1, 1, 1)),
    ('NLC, layer scale', (3, 7, 4), (4, )),
    ('NLC, per sample and channel', (3, 7, 4), (3, 1, 4)),
    ('same shape', (2, 3), (2, 3)),
]


@pytest.mark.parametrize('batched', [False, True])
@pytest.mark.parametrize('name,shape,fshape', CASES)
def test_gradients_equal_plain_autograd(name, shape, fshape, batched, monkeypatch):
    # batched: the factor's gradient as the batched product a GPU takes, here on CPU
    monkeypatch.setattr(lean_layers, '_batched_sums', lambda device: batched)
    g = torch.Generator().manual_seed(0)
    x, b = (torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    f = torch.randn(fshape, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    want_out = x + b * f
    want = torch.autograd.grad(want_out, (x, b, f), w)
    out = ScaledAdd.apply(x, b, f)
    got = torch.autograd.grad(out, (x, b, f), w)
    torch.testing.assert_close(out, want_out, rtol=1e-14, atol=1e-14)
    for a, e in zip(got, want):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    # the branch is kept only for the factor's gradient
    out = ScaledAdd.apply(x, b, f.detach())
    assert all(t is None or t.data_ptr() != b.data_ptr() for t in out.grad_fn.saved_tensors)
    torch.testing.assert_close(torch.autograd.grad(out, b, w)[0], want[1], rtol=1e-12,
                               atol=1e-12)


def test_half_precision_branch_gets_its_gradient_in_its_dtype():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 5, generator=g, requires_grad=True)
    b = torch.randn(2, 3, 4, 5, generator=g).bfloat16().requires_grad_()
    f = torch.rand(1, 3, 1, 1, generator=g, requires_grad=True)
    w = torch.randn(2, 3, 4, 5, generator=g)
    out = scaled_add(x, b, f)
    assert out.dtype == torch.float32
    gx, gb, gf = torch.autograd.grad(out, (x, b, f), w)
    assert gb.dtype == torch.bfloat16 and gf.dtype == torch.float32
    torch.testing.assert_close(out, x + b.float() * f, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gb, (w * f).bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(gf, (w * b.float()).sum((0, 2, 3), keepdim=True), rtol=1e-5,
                               atol=1e-6)
    assert torch.equal(gx, w)


def test_sums_over_trailing_dims_are_one_batched_product():
    """The factor's gradient over trailing dims (NCHW maps, a (B, C, 1, 1) factor): one ``bmm``
    that reads ``grad`` and ``b`` once and writes (B, C) values, no full-size product."""
    grad, b = (torch.empty(8, 64, 200, 336, device='meta') for _ in range(2))
    with TrafficCounter() as t:
        out = _sum_of_products(grad, b, (8, 64, 1, 1))
    assert out.shape == (8, 64, 1, 1) and set(t.by_name) == {'bmm'}
    assert t.bytes_moved == 2 * grad.numel() * 4 + 8 * 64 * 4
    with TrafficCounter() as t:  # a layer scale: then a sum over the samples, small
        assert _sum_of_products(grad, b, (1, 64, 1, 1)).shape == (1, 64, 1, 1)
    assert t.by_name == {'bmm': 1, 'sum': 1}


def test_what_a_step_under_autocast_moves():
    """Counted as on a GPU under autocast (bf16 branch, float32 residual): forward one pass
    (x and b read, the sum written); backward b's gradient written in bfloat16 in one pass, and
    f's as the product and its sum (mixed dtypes: two passes more)."""
    x = torch.empty(8, 64, 200, 336, device='meta', requires_grad=True)
    b0 = torch.empty(8, 64, 200, 336, device='meta', requires_grad=True)
    f = torch.empty(8, 64, 1, 1, device='meta', requires_grad=True)
    n = x.numel()
    with meta_autocast(torch.bfloat16):
        b = b0.bfloat16()
    with TrafficCounter() as fw:
        out = scaled_add(x, b, f)
    assert fw.bytes_moved == n * (4 + 2 + 4) + f.numel() * 4
    grad = torch.empty_like(out)
    with TrafficCounter() as bw:
        gb, gf = torch.autograd.grad(out, (b, f), grad)
    assert gb.dtype == torch.bfloat16
    # mul into bfloat16: grad read, gb written; the product for f (grad, b read, written) and
    # its sum; small terms
    big = n * (4 + 2) + n * (4 + 2 + 4) + n * 4
    assert big <= bw.bytes_moved < big + 2 ** 20, bw.records


def test_double_backward_with_a_half_precision_branch():
    """A graph of the backward (``create_graph``) works: the branch's gradient is then cast
    after the product (no ``out=``), and its own gradients are those of plain autograd."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 3, 4, 5, generator=g).bfloat16().requires_grad_()
    f = torch.rand(1, 3, 1, 1, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64)
    res = []
    for fn in (lambda: x + b.double() * f, lambda: scaled_add(x, b, f)):
        gb, gf = torch.autograd.grad(fn(), (b, f), w, create_graph=True)
        assert gb.dtype == torch.bfloat16
        res.append(torch.autograd.grad(gb.double().square().sum() + gf.sum(), f)[0])
    torch.testing.assert_close(res[1], res[0], rtol=1e-12, atol=1e-12)
