"""How many operations the training forms issue off CPU (counted on ``meta`` tensors: shapes only,
the paths a model takes on a GPU: one chunk, sums over the tokens in parts). At batch 1 a GPU
training step is paced by the host, one launch per operation; these bounds are the counts of
version 0.6.6 (``docs/benchmarks.md``, "Operations per training step"), so that a change that
adds operations to a training form shows here."""
import pytest
import torch

from linattn_mm.models.attentions.nala import RoPE2d
from linattn_mm.models.attentions.softmax import WindowSoftmaxAttention
from linattn_mm.ops.lean_layers import SplitLinear
from linattn_mm.ops.nala import apply_rope, nala_attention_fast, rotate_pairs
from linattn_mm.ops.pola import polarity_attention_fast
from linattn_mm.utils import OperationCounter

META = torch.device('meta')


def count(fn):
    with OperationCounter() as ops:
        fn()
    return ops


def test_operation_counter_counts_operations_not_views():
    x, y = torch.randn(4, 3), torch.randn(3, 5)
    ops = count(lambda: (torch.mm(x + 1, y).t().sum(), x.view(3, 4)[1:], x.transpose(0, 1)))
    assert ops.total == 3 and dict(ops.by_name) == {'add': 1, 'mm': 1, 'sum': 1}


def leaves(*shapes):
    return [torch.randn(*s, device=META, requires_grad=True) for s in shapes]


def backward_ops(outs):
    """Operations of the backward from ``outs`` (their gradients made outside the count)."""
    outs = outs if isinstance(outs, (tuple, list)) else [outs]
    grads = [torch.ones_like(o) for o in outs]
    return count(lambda: torch.autograd.backward(outs, grads))


def test_split_projection_backward_is_one_product_each_way():
    """The four parts' gradients joined, then one GEMM for the input, one product over the tokens
    (in parts: a batched GEMM and a sum) and one sum for the bias, as plain autograd."""
    x, w, b = leaves((1, 8192, 96), (384, 96), (384, ))
    ops = backward_ops(SplitLinear.apply(x, w, b, 4))
    assert dict(ops.by_name) == {'cat': 1, 'mm': 1, 'bmm': 1, '_unsafe_view': 1, 'sum': 2}


@pytest.mark.parametrize('core,most', [('pola', 90), ('nala', 115), ('nala rope', 147)])
def test_core_training_step_operations(core, most):
    """Forward and backward of a core at a stage-1 shape (8192 tokens, 3 heads of 32), after a
    first call."""
    q, k, v = leaves(*[(1, 3, 8192, 32)] * 3)
    p, s, pe = leaves((1, 3, 1, 32), (1, 3, 1, 32), (1, 3, 8192, 32))
    sin, cos = RoPE2d(32).to(META)((64, 128)) if 'rope' in core else (None, None)

    def step():
        if core == 'pola':
            y = polarity_attention_fast(q, k, v, 1 + p.sigmoid(), 1e-6, s, pe)
        else:
            y = nala_attention_fast(q, k, v, 3., 1e-6, sin, cos)
        y.backward(torch.ones_like(y))

    step()  # a first call meets the one-time look-ups (dtype promotions)
    with OperationCounter() as ops:
        step()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert ops.total <= most, ops.by_name


def test_rope_as_complex_products_issues_fewer_operations():
    """The softmax stages' training form of the RoPE (complex products of the channel pairs):
    two operations forward (the angles as complex numbers, one product) where the reference's
    rotate-half takes five, and fewer backward."""
    q, = leaves((2, 4, 300, 32))
    sin, cos = RoPE2d(32).to(META)((15, 20))
    counts = {}
    for name, fn in (('ref', lambda: apply_rope(q, sin, cos)),
                     ('new', lambda: rotate_pairs(q, sin, cos))):
        fwd = count(lambda: counts.__setitem__(name, fn()))
        counts[name] = (fwd.total, backward_ops(counts[name]).total)
    assert counts['new'][0] == 2 and counts['ref'][0] == 5
    assert counts['new'][1] < counts['ref'][1], counts


def test_shifted_windows_take_their_mask_from_the_table():
    """After a first call, a shifted window attention's forward issues one operation more than an
    unshifted one (the mask's addition to the position bias): the shift mask (and the window
    layout) of a grid size is made once, where a forward rebuilt it (about 25 operations) as
    stock Swin does."""
    counts = {}
    for shift in (False, True):
        attn = WindowSoftmaxAttention(64, 2, window_size=7, shift=shift).to(META)
        x, = leaves((1, 50 * 84, 64))
        attn(x, (50, 84))
        counts[shift] = count(lambda: attn(x, (50, 84)))
    assert counts[True].total == counts[False].total + 1, (counts[True].by_name,
                                                           counts[False].by_name)
