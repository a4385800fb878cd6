"""``DropPath.add``: the residual sum of a dropped branch as one ``addcmul``, the same samples
dropped and kept (the same random numbers as ``x + drop_path(branch)``), the kept ones scaled by
``1 / keep``, and their gradients."""
import pytest
import torch

from linattn_mm.models.utils.layers import DropPath
from linattn_mm.utils import OperationCounter


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
    """The mask (a new buffer, its Bernoulli draw) and one ``addcmul``: three operations, where
    the product and the sum take five."""
    dp = DropPath(0.2).train()
    x, b = (torch.empty(2, 4096, 96, device='meta') for _ in range(2))
    for fn, n in ((lambda: dp.add(x, b), 3), (lambda: x + dp(b), 5)):
        with OperationCounter() as ops:
            fn()
        assert ops.total == n, ops.by_name
