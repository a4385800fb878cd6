"""How many operations the training forms issue off CPU (counted on ``meta`` tensors: shapes only,
the paths a model takes on a GPU: one chunk, sums over the tokens in parts). At batch 1 a GPU
training step is paced by the host, one launch per operation; these bounds are the counts of
version 0.6.7 (``docs/benchmarks.md``, "Operations per training step"), so that a change that
adds operations to a training form shows here. The bytes and FLOPs counted with them
(``TrafficCounter``) are checked against sums written out by hand."""
import pytest
import torch

from linattn_mm.models.attentions.nala import RoPE2d
from linattn_mm.models.attentions.softmax import WindowSoftmaxAttention
from linattn_mm.ops.lean_layers import SplitLinear
from linattn_mm.ops.nala import RopeTables, apply_rope, nala_attention_fast, rotate_pairs
from linattn_mm.ops.nala.fast import _rot_rows, rope_fold
from linattn_mm.ops.pola import polarity_attention_fast
from linattn_mm.utils import OperationCounter, OperationsByModule, TrafficCounter

META = torch.device('meta')


def count(fn):
    with OperationCounter() as ops:
        fn()
    return ops


def test_operation_counter_counts_operations_not_views():
    x, y = torch.randn(4, 3), torch.randn(3, 5)
    ops = count(lambda: (torch.mm(x + 1, y).t().sum(), x.view(3, 4)[1:], x.transpose(0, 1)))
    assert ops.total == 3 and dict(ops.by_name) == {'add': 1, 'mm': 1, 'sum': 1}


def test_traffic_counter_bytes_and_flops_by_hand():
    """Bytes: every tensor argument's addressed elements once (a broadcast dimension once) plus
    the outputs'; a copy reads its source and writes its destination; a new uninitialised buffer
    and views move nothing; a fill writes only. FLOPs: 2 m n k for a product."""
    a, b, w = (torch.empty(s, device=META) for s in ((64, 32), (32, ), (32, 16)))
    with TrafficCounter() as t:
        c = a + b  # reads 64*32 + 32, writes 64*32
        d = a @ w  # reads 64*32 + 32*16, writes 64*16
        c.copy_(a)  # reads 64*32, writes 64*32
        e = torch.empty(10, 10, device=META)  # nothing
        e.fill_(1.)  # writes 100
        a.t().view(-1, 64)[:3]  # views: not operations
        torch.ops.aten._unsafe_view(d, (16, 64))  # an operation, but no kernel: nothing moved
    assert [r[:3] for r in t.records] == [
        ('add', (2048 + 32 + 2048) * 4, 0), ('mm', (2048 + 512 + 1024) * 4, 2 * 64 * 32 * 16),
        ('copy_', 2 * 2048 * 4, 0), ('empty', 0, 0), ('fill_', 100 * 4, 0),
        ('_unsafe_view', 0, 0)]
    assert t.total == 6 and t.bytes_moved == sum(r[1] for r in t.records)
    assert t.flops == 2 * 64 * 32 * 16
    # the roofline: each operation at least its bytes over the bandwidth and its FLOPs over the
    # rate of its dtype
    got = t.roofline_seconds(1e9, {torch.float32: 1e6})
    want = 4128 * 4 / 1e9 + 2 * 64 * 32 * 16 / 1e6 + 4096 * 4 / 1e9 + 400 / 1e9
    assert got == pytest.approx(want, rel=1e-12)


def test_traffic_counter_counts_a_grouped_convolution_backward_by_its_groups():
    """A depth-wise 3x3 convolution: forward 2 C H W 9 FLOPs, its backward the same once for the
    input's gradient and once for the weight's (torch's own formula leaves the groups out there
    and counts C times as many)."""
    C, H, W = 64, 20, 30
    x, wt = leaves((1, C, H, W), (C, 1, 3, 3))
    with TrafficCounter() as t:
        y = torch.nn.functional.conv2d(x, wt, padding=1, groups=C)
        y.backward(torch.ones_like(y))
    fwd = 2 * C * H * W * 9
    flops = {r[0]: r[2] for r in t.records if r[2]}
    assert flops == {'convolution': fwd, 'convolution_backward': 2 * fwd}
    # a transposed convolution (the ViT FPN's 2x2 up-sampling): its forward by torch's formula,
    # 2 * inputs * (out-channels * kernel), and the backward twice that
    x, wt = leaves((1, 8, 10, 12), (8, 8, 2, 2))
    with TrafficCounter() as t:
        y = torch.nn.functional.conv_transpose2d(x, wt, stride=2)
        y.backward(torch.ones_like(y))
    fwd = 2 * 8 * 10 * 12 * 8 * 4
    flops = {r[0]: r[2] for r in t.records if r[2]}
    assert flops == {'convolution': fwd, 'convolution_backward': 2 * fwd}


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu() * 2


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Inner(), _Inner()

    def forward(self, x):
        x = x.exp()  # the outer module's own operations: before and between its children
        return self.b(self.a(x) + 1)


def test_operations_by_module_by_hand():
    """Forward: each operation for the innermost module running; backward: for the module whose
    forward made the node (the ops of a node made between two children go to their parent, not
    to the child after them); the loss and its seed outside. Bytes per entry add up to the
    total."""
    model = _Outer().to(META)
    x = torch.randn(3, 4, device=META, requires_grad=True)
    with OperationsByModule(model) as ops:
        model(x).sum().backward()
    got = {k: v[0] for k, v in ops.by_module.items()}
    assert got == {
        ('_Outer', 'forward'): 2,  # exp, add
        ('_Inner', 'forward'): 4,  # relu, mul (x2)
        ('Linear', 'forward'): 2,  # addmm (x2)
        ('(outside)', 'forward'): 2,  # sum, the backward's seed (ones_like)
        ('Linear', 'backward'): 6,  # input and weight products, bias sum (x2)
        ('_Inner', 'backward'): 4,  # threshold_backward, mul (x2)
        ('_Outer', 'backward'): 1,  # exp's: a product with its output
    }
    assert sum(got.values()) == ops.total == 21
    assert sum(v[1] for v in ops.by_module.values()) == ops.bytes_moved
    # the Linear's bytes forward: (4 + 3*4 + 4*4 + 3*4) float32 elements per addmm
    assert ops.by_module[('Linear', 'forward')][1] == 2 * (4 + 12 + 16 + 12) * 4
    # the hooks go with the counter
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class _Fallback(torch.nn.Module):
    """Tries a child that raises, then does the work itself."""

    def __init__(self):
        super().__init__()
        self.bad, self.lin = _Raises(), torch.nn.Linear(4, 4)

    def forward(self, x):
        try:
            return self.bad(x)
        except RuntimeError:
            return self.lin(x).exp() * 2


class _Raises(torch.nn.Module):
    def forward(self, x):
        x.sin()
        raise RuntimeError('no')


def test_operations_by_module_after_a_raise_and_in_nested_counters():
    """A child that raises is left at the raise: the parent's own operations after it count for
    the parent, forward and backward, and the loss outside. Two counters nested on a model and
    on one of its parts each count for their own modules."""
    model = _Fallback().to(META)
    x = torch.randn(3, 4, device=META, requires_grad=True)
    with OperationsByModule(model) as ops:
        model(x).sum().backward()
    assert {k: v[0] for k, v in ops.by_module.items()} == {
        ('_Raises', 'forward'): 1,  # sin
        ('Linear', 'forward'): 1, ('_Fallback', 'forward'): 2,  # exp, mul
        ('(outside)', 'forward'): 2,  # sum, seed
        ('_Fallback', 'backward'): 2, ('Linear', 'backward'): 3}
    outer = _Outer().to(META)
    x.grad = None  # no accumulation
    with OperationsByModule(outer) as whole, OperationsByModule(outer.a) as part:
        outer(x).sum().backward()
    assert {k: v[0] for k, v in part.by_module.items()} == {
        ('_Inner', 'forward'): 2, ('Linear', 'forward'): 1, ('_Inner', 'backward'): 2,
        ('Linear', 'backward'): 3, ('(outside)', 'forward'): 7, ('(outside)', 'backward'): 6}
    assert whole.by_module[('_Outer', 'forward')][0] == 2
    assert whole.by_module[('_Inner', 'backward')][0] == 4
    assert part.total == whole.total == 21


def test_operations_by_module_adds_up_to_a_training_step():
    """A whole training step of a NaLa block stack under checkpointing: every operation is
    counted once, the recomputation in the backward as backward (for the block, whose residual
    sum's node asks for it first)."""
    from linattn_mm.models.backbones.nalaformer import NaLaBlock
    block = NaLaBlock(16, 2, dict(type='NormAwareLinearAttention'), drop_path=0.1)
    x = torch.randn(2, 16, 6, 8, device=META, requires_grad=True)
    block.to(META).train()

    def step():  # the gradients of the step before cleared: no accumulation
        block.zero_grad(set_to_none=True)
        x.grad = None
        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        y.square().mean().backward()
    step()  # the first step makes the RoPE tables the next ones reuse
    with OperationCounter() as plain:
        step()
    with OperationsByModule(block) as ops:
        step()
    assert ops.total == plain.total
    with OperationsByModule(block) as twice:  # the checkpoint's early stop leaves nothing behind
        step()
        step()
    assert {k: 2 * v[0] for k, v in ops.by_module.items()} == {
        k: v[0] for k, v in twice.by_module.items()}
    assert sum(v[0] for v in ops.by_module.values()) == ops.total
    phases = {p for _, p in ops.by_module}
    assert phases == {'forward', 'backward'}
    assert ops.by_module[('NormAwareLinearAttention', 'backward')][0] > 0
    # the recomputed forward: counted forward once, and again in the block's backward
    with OperationsByModule(block) as eager:
        block.zero_grad(set_to_none=True)
        x.grad = None
        block(x).square().mean().backward()
    forward = sum(v[0] for (_, p), v in eager.by_module.items() if p == 'forward')
    extra = ops.by_module[('NaLaBlock', 'backward')][0] - eager.by_module[('NaLaBlock',
                                                                           'backward')][0]
    assert ops.total - eager.total == extra == forward - eager.by_module[('(outside)',
                                                                          'forward')][0]


def test_rope_fold_is_the_eight_steps_bit_for_bit_in_three_operations():
    """The key side's ``[M ; -rot(M)]``, ``M = (A_cos + rot(A_sin)) / n``, as ``(a + Q a) / n``
    with ``Q`` a signed permutation of the rows: the same bits as the steps written out, in three
    operations (a row gather, one ``addcmul``, the scale) where they take eight."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        D, n = 64, 8191
        a = torch.randn(2, 3, 2 * D, 32, generator=g, dtype=dtype)
        m = (a[..., :D, :] + _rot_rows(a[..., D:, :])) * (1.0 / n)
        assert torch.equal(rope_fold(a, n), torch.cat([m, -_rot_rows(m)], dim=-2))
    a = torch.empty(2, 3, 2 * D, 32, device=META)
    rope_fold(a, n)  # the row order and signs: made once
    assert count(lambda: rope_fold(a, n)).total == 3


def test_rope_tables_shared_by_q_and_k():
    """Rotations by the shared tables of a stage (``RopeTables``): bit for bit those of the tables
    alone, gradients included; the complex tables are made once (two operations), then each
    tensor takes one product forward and one backward, where alone it takes two and three."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 300, 32, generator=g, dtype=torch.float64)
    sin, cos = (t.double() for t in RoPE2d(32)((15, 20)))
    w = torch.randn(2, 4, 300, 32, generator=g, dtype=torch.float64)
    outs = []
    for shared in (None, RopeTables(sin, cos)):
        t = x.clone().requires_grad_()
        y = rotate_pairs(t, sin, cos, shared)
        y.backward(w)
        outs.append((y.detach(), t.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    q, k = leaves((2, 4, 300, 32), (2, 4, 300, 32))
    sin, cos = RoPE2d(32).to(META)((15, 20))
    tables = RopeTables(sin, cos)
    fwd = count(lambda: tables.turns(sin, cos))
    assert fwd.total == 2  # the turn and its conjugate
    ys = []
    fwd = count(lambda: ys.extend([rotate_pairs(q, sin, cos, tables),
                                   rotate_pairs(k, sin, cos, tables)]))
    assert fwd.total == 2 and backward_ops(ys).total == 2, (fwd.by_name, backward_ops(ys).by_name)


def test_rope_tables_made_in_inference_mode_are_not_kept_for_training():
    """The complex tables a ``RopeTables`` makes under ``torch.inference_mode()`` are inference
    tensors: a later training step with the same tables makes its own (its backward keeps
    them)."""
    tables = RopeTables(*RoPE2d(8)((3, 4)))
    x = torch.randn(1, 2, 12, 8, dtype=torch.float32)
    with torch.inference_mode():
        rotate_pairs(x, *tables, tables)
    t = x.clone().requires_grad_()
    rotate_pairs(t, *tables, tables).sum().backward()
    assert t.grad is not None and len(tables._turns) == 2


def test_rope_tables_copy_and_pickle_as_the_pair():
    """Copies and pickles of ``RopeTables`` hold the same tables and make their complex tables
    anew."""
    import copy
    import pickle
    tables = RopeTables(*RoPE2d(8)((3, 4)))
    tables.turns(*tables)
    for other in (copy.copy(tables), copy.deepcopy(tables), pickle.loads(pickle.dumps(tables))):
        assert type(other) is RopeTables and other._turns == {}
        assert all(torch.equal(a, b) for a, b in zip(other, tables)) and len(other) == 2


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


@pytest.mark.parametrize('core,most', [('pola', 90), ('nala', 107), ('nala rope', 127)])
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


@pytest.mark.skipif(__import__('linattn_mm.ops.pola.triton', fromlist=['triton']).triton is None,
                    reason='Triton is not installed')
def test_triton_pola_core_on_meta_is_four_launches_with_their_traffic():
    # a training step of the Triton Pola core on meta tensors: its four kernels are one operation
    # each, with the bytes of the tensors each reads and writes (as the kernel addresses them) and
    # the FLOPs of its (tokens x DP) by (DP x DP) products, DP the head dim padded to 16
    from linattn_mm.ops.pola import polarity_attention
    B, h, N, d, DP = 2, 3, 40, 12, 16
    meta = dict(device='meta')
    q, k, v = (torch.empty(B, h, N, d, **meta, requires_grad=True) for _ in range(3))
    p, s = (torch.empty(1, h, 1, d, **meta, requires_grad=True) for _ in range(2))
    pe = torch.empty(1, h, N, d, **meta, requires_grad=True)
    with TrafficCounter() as tc:
        out = polarity_attention(q, k, v, p, 1e-6, s, pe, core='triton')
        out.backward(torch.empty_like(out))
    launches = [r for r in tc.records if r[0].startswith('pola_triton')]
    assert [r[0] for r in launches] == ['pola_triton_keys', 'pola_triton_queries',
                                        'pola_triton_query_grads', 'pola_triton_key_grads']
    full, param, bh = B * h * N * d * 4, h * d * 4, B * h  # bytes
    pe_bytes = h * N * d * 4  # broadcast over the batch: addressed once
    state, means, vec = bh * 2 * DP * DP * 4, bh * 2 * DP * 4, bh * DP * 4
    # partial sums per chunk: the forward's blocks of 64 tokens make one chunk of the 40, the
    # gradient passes' blocks of 32 (core_launch's at d <= 32) two
    chunks = 2
    want = {
        # k, v, pe, p, 1/s -> partial [k+^T v, k-^T v], [sum k+, sum k-]
        'pola_triton_keys': 2 * full + pe_bytes + 2 * param + state + means,
        # q, [W+, W-], key means, p, 1/s -> out
        'pola_triton_queries': full + state + means + 2 * param + full,
        # q, grad, W, means, p, 1/s -> dq, dW, d means, d(1/s), dp
        'pola_triton_query_grads': 2 * full + state + means + 2 * param + full
        + chunks * (state + means + 2 * vec),
        # k, v, pe, p, 1/s, dKV, d sums -> dk (float32: the bias's gradient is summed from it),
        # dv, d(1/s), dp
        'pola_triton_key_grads': 2 * full + pe_bytes + 2 * param + state + means + 2 * full
        + chunks * 2 * vec,
    }
    flops = {'pola_triton_keys': 2, 'pola_triton_queries': 2, 'pola_triton_query_grads': 6,
             'pola_triton_key_grads': 4}
    for name, nbytes, nflops, _ in launches:
        assert nbytes == want[name], name
        assert nflops == 2 * flops[name] * B * h * N * DP * DP, name
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v, p, s, pe))


@pytest.mark.skipif(__import__('linattn_mm.ops.pola.triton', fromlist=['triton']).triton is None,
                    reason='Triton is not installed')
def test_triton_nala_core_on_meta_is_four_launches_with_their_traffic():
    # the NaLa Triton core (with the RoPE) on meta tensors: four launches, each one operation
    # with the bytes of what its kernel reads and writes and the FLOPs of its products (four
    # (tokens x DP) by (DP x DP) products per token forward, twelve and eight backward)
    from linattn_mm.ops.nala import nala_attention
    B, h, (H, W), d, DP = 2, 3, (5, 8), 12, 16
    N = H * W
    q, k, v = (torch.empty(B, h, N, d, device='meta', requires_grad=True) for _ in range(3))
    sin, cos = (torch.empty(N, d, device='meta') for _ in range(2))
    with TrafficCounter() as tc:
        out = nala_attention(q, k, v, 3., 1e-6, sin, cos, core='triton')
        out.backward(torch.empty_like(out))
    launches = [r for r in tc.records if r[0].startswith('nala_triton')]
    assert [r[0] for r in launches] == ['nala_triton_keys', 'nala_triton_queries',
                                        'nala_triton_query_grads', 'nala_triton_key_grads']
    full, table, bh = B * h * N * d * 4, N * d * 4, B * h
    mats, means = bh * 4 * DP * DP * 4, bh * 2 * DP * 4
    chunks = 2  # of the query gradients' partial sums: blocks of 32 (d <= 32), 40 tokens
    want = {'nala_triton_keys': 2 * full + 2 * table + mats + means,  # k, v, sin, cos -> sums
            'nala_triton_queries': full + mats + means + 2 * table + full,  # q, W, means -> out
            # q, grad, W, means, sin, cos -> dq, dW, d means
            'nala_triton_query_grads': 2 * full + mats + means + 2 * table + full
            + chunks * (mats + means),
            # k, v, sin, cos, dW, d sums -> dk, dv
            'nala_triton_key_grads': 2 * full + 2 * table + mats + means + 2 * full}
    flops = {'nala_triton_keys': 4, 'nala_triton_queries': 4, 'nala_triton_query_grads': 12,
             'nala_triton_key_grads': 8}
    for name, nbytes, nflops, _ in launches:
        assert nbytes == want[name], name
        assert nflops == 2 * flops[name] * B * h * N * DP * DP, name
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


@pytest.mark.skipif(__import__('linattn_mm.ops.pola.triton', fromlist=['triton']).triton is None,
                    reason='Triton is not installed')
@pytest.mark.parametrize('family', ['pola', 'nala'])
def test_triton_launches_count_their_products_at_the_float32_rate(family):
    # bf16 q, k, v (a step under autocast): the launches' products run in float32 (FMA loops, the
    # default 'ieee' precision), so the roofline takes their FLOPs at the float32 rate, not at
    # the tensor cores' bf16 rate of their inputs (0.6.11 and before did)
    from linattn_mm.ops.nala import nala_attention
    from linattn_mm.ops.pola import polarity_attention
    B, h, N, d, DP = 2, 3, 40, 32, 32
    q, k, v = (torch.empty(B, h, N, d, device='meta', dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    with TrafficCounter() as tc:
        if family == 'pola':
            out = polarity_attention(q, k, v, torch.empty(1, h, 1, d, device='meta'), 1e-6,
                                     core='triton')
        else:
            out = nala_attention(q, k, v, 3., 1e-6, core='triton')
        out.backward(torch.empty_like(out))
    launches = [r for r in tc.records if r[0].startswith(f'{family}_triton')]
    assert len(launches) == 4 and {r[3] for r in launches} == {torch.float32}
    factors = 14 if family == 'pola' else 28  # products per token over the four launches
    assert sum(r[2] for r in launches) == 2 * factors * B * h * N * DP * DP
    # with a bandwidth that costs nothing, the bound is the FLOPs over their rates: the
    # launches' at the float32 rate (1 FLOP/s here), nothing else computes products
    rates = {torch.float32: 1.0, torch.bfloat16: 1e30}
    assert tc.roofline_seconds(1e30, rates) == pytest.approx(sum(r[2] for r in launches))
    assert [r for r in tc.records if r[2] and not r[0].startswith(f'{family}_triton')] == []
