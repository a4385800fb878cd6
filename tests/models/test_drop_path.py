"""``DropPath.add``: the residual sum of a dropped branch as one ``addcmul``, the same samples
dropped and kept (the same random numbers as ``x + drop_path(branch)``), the kept ones scaled by
``1 / keep``, and their gradients."""
import pytest
import torch

from linattn_mm.models.utils.layers import DropPath
from linattn_mm.utils import OperationCounter, TrafficCounter


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_add_equals_the_sum_of_the_dropped_branch(dtype):
    dp = DropPath(0.3).train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 50, 8, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(16, 50, 8, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(16, 50, 8, generator=g, dtype=dtype)
    res = []
    for fn in (lambda: x + dp(b), lambda: dp.add(x, b)):
        torch.manual_seed(5)
        y = fn()
        y.backward(w)
        res.append((y.detach(), x.grad.clone(), b.grad.clone()))
        x.grad = b.grad = None
    (y0, gx0, gb0), (y1, gx1, gb1) = res
    dropped = (gb0 == 0).all(-1).all(-1)
    assert 0 < int(dropped.sum()) < 16  # some samples dropped, some kept
    # dropped samples: exactly x, no gradient for the branch; kept: x + b / keep
    assert torch.equal(y1[dropped], x.detach()[dropped])
    assert torch.equal(gb1[dropped], torch.zeros_like(gb1[dropped]))
    keep = ~dropped
    want = x.detach()[keep] + b.detach()[keep] / 0.7
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(y1[keep], want, **tol)
    torch.testing.assert_close(y1, y0, **tol)
    assert torch.equal(gx1, w) and torch.equal(gx0, w)
    torch.testing.assert_close(gb1, gb0, **tol)


def test_add_without_dropping_is_the_plain_sum():
    x, b = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
    assert torch.equal(DropPath(0.3).eval().add(x, b), x + b)
    assert torch.equal(DropPath(0.).train().add(x, b), x + b)


def test_add_is_one_operation_over_the_maps():
    """The mask (a new buffer, its Bernoulli draw, its ``1 / keep``) and one ``addcmul``: one
    operation over the maps, where the product and the sum take two (five in all)."""
    dp = DropPath(0.2).train()
    x, b = (torch.empty(2, 4096, 96, device='meta') for _ in range(2))
    for fn, n in ((lambda: dp.add(x, b), 4), (lambda: x + dp(b), 5)):
        with OperationCounter() as ops:
            fn()
        assert ops.total == n, ops.by_name


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('training', [True, False])
def test_add_with_a_layer_scale_equals_the_scaled_branch(dtype, training):
    """``add(x, b, scale)`` is ``x + drop_path(scale * b)``: the same samples dropped, the same
    values and gradients (of x, the branch and the scale) up to the order of the products."""
    dp = DropPath(0.3).train(training)
    g = torch.Generator().manual_seed(1)
    x, b = (torch.randn(16, 6, 5, 7, generator=g, dtype=dtype, requires_grad=True)
            for _ in range(2))
    gamma = (torch.rand(1, 6, 1, 1, generator=g, dtype=dtype) + 0.5).requires_grad_()
    w = torch.randn(16, 6, 5, 7, generator=g, dtype=dtype)
    res = []
    for fn in (lambda: x + dp(gamma * b), lambda: dp.add(x, b, gamma)):
        torch.manual_seed(5)
        y = fn()
        res.append((y, *torch.autograd.grad(y, (x, b, gamma), w)))
    # the scale's gradient sums 560 products per channel, in another order: float32 to 1e-5
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-14, atol=1e-14)
    for want, got in zip(*res):
        torch.testing.assert_close(got, want, **tol)
    kept = int((res[1][2] != 0).any(-1).any(-1).any(-1).sum())  # samples whose branch counts
    assert (0 < kept < 16) if training else kept == 16


def test_add_under_autocast_reads_the_half_precision_branch_as_it_is():
    """A half-precision branch (autocast's) added to a float32 ``x``: the values of the float32
    sum, and under CUDA's autocast (counted on meta) no float32 copy of the branch first."""
    from linattn_mm.utils import meta_autocast
    dp = DropPath(0.25).train()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 4, 6, generator=g)
    b = torch.randn(8, 4, 6, generator=g).bfloat16()
    gamma = torch.rand(4, 1, generator=g)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        torch.manual_seed(3)
        got = dp.add(x, b, gamma)
    torch.manual_seed(3)
    mask = DropPath._mask(b, 0.75)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x + b.float() * (gamma * mask.float()) / 0.75, rtol=1e-6,
                               atol=1e-6)
    xm, bm = torch.empty(2, 4096, 96, device='meta'), torch.empty(2, 4096, 96, device='meta')
    full = xm.numel()
    for scale in (None, torch.empty(96, device='meta')):
        with meta_autocast(torch.bfloat16):
            half = bm.bfloat16()
            with TrafficCounter() as ops:
                out = dp.add(xm, half, scale)
        assert out.dtype == torch.float32
        # x read, the branch read as it is (2 bytes a value), the sum written; the rest small
        assert full * (4 + 2 + 4) <= ops.bytes_moved < full * (4 + 2 + 4) + 2 ** 16, ops.by_name


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('training', [True, False])
def test_add_keeps_the_dtype_of_a_half_precision_model(dtype, training):
    """A model in half precision throughout (no autocast): the sum has the dtype of
    ``x + drop_path(scale * branch)`` in training as in eval (the float32 factor of the mask and
    ``1 / keep`` does not promote it), and its values within the dtype's rounding."""
    dp = DropPath(0.3).train(training)
    g = torch.Generator().manual_seed(4)
    x, b = (torch.randn(16, 6, 5, 7, generator=g).to(dtype) for _ in range(2))
    for scale in (None, torch.rand(1, 6, 1, 1, generator=g).to(dtype)):
        torch.manual_seed(5)
        want = x + dp(b if scale is None else scale * b)
        torch.manual_seed(5)
        got = dp.add(x, b, scale)
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6)
