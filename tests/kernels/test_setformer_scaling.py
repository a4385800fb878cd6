"""SeT's fast Sinkhorn (scaling domain, :mod:`linattn_mm.ops.setformer.autograd`) against the
log-domain loop (the reference, itself checked against plain autograd and a dense oracle in
tests/models/test_setformer.py): the same potentials, plans and gradients of the log-kernel and of
both marginals, with padded rows; the mixer's choice of loop."""
import math

import pytest
import torch

import linattn_mm  # noqa: F401  (registers everything)
from linattn_mm.models.attentions.setformer import SeTAttention
from linattn_mm.ops.setformer import log_sinkhorn, transport_plan
from linattn_mm.ops.setformer.autograd import (MAX_LOG_RANGE, scaling_sinkhorn,
                                               self_transport_attention_fast)


def marginals(B, n, m, dtype, pad_rows=0):
    """Log marginals: rows (B, 1, n) with the last ``pad_rows`` rows of sample 1 padded (-inf,
    the others 1/n_valid), columns (1, 1, 1) = -log m."""
    pad = torch.zeros(B, n, dtype=torch.bool)
    if pad_rows:
        pad[1, -pad_rows:] = True
    row = (-(~pad).sum(-1, keepdim=True).to(dtype).log()).expand(B, n).masked_fill(pad, -math.inf)
    return row[:, None].clone(), torch.full((1, 1, 1), -math.log(m), dtype=dtype), pad


def run(fn, log_k, row, col, iters, w):
    """Potentials, plan and the gradients of log_k, row and col of a loss on f, g and T."""
    lk, r, c = (t.detach().clone().requires_grad_() for t in (log_k, row, col))
    f, g = fn(lk, r, c, iters)
    T = transport_plan(lk, f, g)
    loss = (T * w).sum() + torch.where(torch.isfinite(f), f, 0.).cos().sum() + (g * g).sum()
    loss.backward()
    return f.detach(), g.detach(), T.detach(), lk.grad, r.grad, c.grad


@pytest.mark.parametrize('iters', [1, 7, 30])
def test_scaling_form_equals_log_domain_float64(iters):
    """float64: potentials, plan and all three gradients within 1e-10 (relative to each tensor's
    largest entry); padded rows get f = -inf, a zero plan row and zero log-kernel gradient."""
    torch.manual_seed(0)
    B, h, n, m = 2, 3, 37, 11
    log_k = torch.randn(B, h, n, m, dtype=torch.float64) * 4  # range ~ 30
    row, col, pad = marginals(B, n, m, torch.float64, pad_rows=5)
    w = torch.randn(B, h, n, m, dtype=torch.float64)
    ref = run(log_sinkhorn, log_k, row, col, iters, w)
    new = run(scaling_sinkhorn, log_k, row, col, iters, w)
    f_ref, f_new = ref[0], new[0]
    assert torch.equal(torch.isinf(f_ref), torch.isinf(f_new))
    assert torch.isinf(f_new[1, :, -5:]).all() and torch.isfinite(f_new[0]).all()
    for name, a, b in zip(('f', 'g', 'T', 'd log_k', 'd row', 'd col'), new, ref):
        a, b = torch.where(torch.isfinite(b), a, 0.), torch.where(torch.isfinite(b), b, 0.)
        err = (a - b).abs().max() / b.abs().max()
        assert err < 1e-10, (name, err.item())
    assert (new[2][1, :, -5:] == 0).all() and (new[3][1, :, -5:] == 0).all()


def test_scaling_form_float32_against_float64_reference():
    """float32 against the float64 log-domain loop: potentials, plan and the three gradients
    within 2e-5 (relative to each tensor's largest entry), and as close as the log-domain loop
    itself in float32 (at most twice its error, or 1e-5)."""
    torch.manual_seed(1)
    B, h, n, m = 2, 2, 300, 120
    log_k = torch.rand(B, h, n, m, dtype=torch.float64) * 10 - 3
    row, col, _ = marginals(B, n, m, torch.float64, pad_rows=20)
    w = torch.randn(B, h, n, m, dtype=torch.float64)
    ref = run(log_sinkhorn, log_k, row, col, 30, w)
    args = (log_k.float(), row.float(), col.float(), 30, w.float())
    errors = []
    for fn in (scaling_sinkhorn, log_sinkhorn):
        errs = []
        for a, b in zip(run(fn, *args), ref):
            ok = torch.isfinite(b)
            a, b = torch.where(ok, a.double(), 0.), torch.where(ok, b, 0.)
            errs.append(((a - b).abs().max() / b.abs().max()).item())
        errors.append(errs)
    for name, new, old in zip(('f', 'g', 'T', 'd log_k', 'd row', 'd col'), *errors):
        assert new < 2e-5 and new <= max(2 * old, 1e-5), (name, new, old)


def test_scaling_form_gradcheck_with_padding():
    torch.manual_seed(0)
    n, m = 7, 5
    log_k = torch.randn(2, n, m, dtype=torch.float64, requires_grad=True)
    row, col, _ = marginals(2, n, m, torch.float64, pad_rows=3)
    row, col = row[:, 0], col[0]
    col.requires_grad_()

    def fn(lk, c):
        f, g = scaling_sinkhorn(lk, row, c, 6)
        return transport_plan(lk, f, g), g

    assert torch.autograd.gradcheck(fn, (log_k, col))


def test_scaling_form_half_inputs_run_in_float32():
    """bf16 log-kernels are scaled in float32: the potentials are those of the float32 input,
    rounded to bf16."""
    torch.manual_seed(0)
    log_k = (torch.randn(1, 2, 50, 20) * 3).bfloat16()
    row, col, _ = marginals(1, 50, 20, torch.float32)
    f, g = scaling_sinkhorn(log_k, row, col, 10)
    f32, g32 = scaling_sinkhorn(log_k.float(), row, col, 10)
    assert f.dtype == g.dtype == torch.bfloat16
    assert torch.equal(f, f32.bfloat16()) and torch.equal(g, g32.bfloat16())
    with pytest.raises(ValueError, match='num_iters'):
        scaling_sinkhorn(log_k, row, col, 0)


def test_scaling_form_backward_inside_autocast_is_the_one_outside():
    """The loop's backward runs with autocast off: a backward() called inside a bf16 autocast
    region gives the gradients of one called after it (its products ran in bf16 there)."""
    torch.manual_seed(0)
    log_k = (torch.randn(2, 40, 24) * 3).requires_grad_()
    row, col, _ = marginals(2, 40, 24, torch.float32)

    def grad(inside):
        log_k.grad = None
        with torch.autocast('cpu', dtype=torch.bfloat16):
            f, g = scaling_sinkhorn(log_k, row, col, 8)
            loss = (f.sin().sum() + g.cos().sum())
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        return log_k.grad.clone()

    torch.testing.assert_close(grad(True), grad(False), rtol=0, atol=0)


def test_mixer_takes_the_scaling_form_only_where_the_kernel_range_is_bounded():
    """``core='fast'`` and a Gaussian kernel whose log-kernel range (< 1/eps, + 1/tau with the
    positional term in the kernel) is at most MAX_LOG_RANGE: the scaling loop; otherwise, and
    for ``core='reference'``, the log-domain one."""
    assert MAX_LOG_RANGE == 30.
    cases = [
        (dict(), 10., scaling_sinkhorn),  # ImageNet defaults: eps 0.1, tau 0.5 on the plan
        (dict(eps=0.3, tau=0.8, position='kernel'), 1 / 0.3 + 1 / 0.8, scaling_sinkhorn),
        (dict(eps=0.1, tau=0.5, position='both'), 12., scaling_sinkhorn),
        (dict(eps=0.03), 1 / 0.03, log_sinkhorn),  # 33.3 > 30
        (dict(kernel='nystrom'), None, log_sinkhorn),  # the Nyström kernel is not bounded
        (dict(core='reference'), 10., log_sinkhorn),
    ]
    for kw, bound, fn in cases:
        mod = SeTAttention(16, 2, num_refs=8, **kw)
        assert mod.log_kernel_range == (None if bound is None else pytest.approx(bound)), kw
        assert mod.sinkhorn is fn, kw


MIXER_CASES = {
    'coco, plan': dict(position='plan'),
    'coco, kernel': dict(position='kernel'),
    'both, key features': dict(position='both', cost_features='key'),
    'no position, constant scale': dict(tau=None, row_normalize=False),
    'class token, padding': dict(num_extra_tokens=1, padded=True),
    'kernel, padding, constant scale': dict(position='kernel', row_normalize=False, padded=True),
    'buffer refs, a fully padded sample, groups of 4 slices': dict(
        refs_learnable=False, padded='full', group_slices=4),
}


def core_nodes(t):
    """Names of the autograd nodes behind ``t``."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [n for n, _ in node.next_functions]
    return names


@pytest.mark.parametrize('case', list(MIXER_CASES))
def test_mixer_fast_and_reference_agree(case, monkeypatch):
    """The whole mixer in float64 (COCO settings eps 0.3, tau 0.8 unless the case says
    otherwise): output and the gradients of the input and of every parameter within 1e-10
    between the fast form (:class:`SelfTransportAttention`: Gaussian kernel, scaling loop, one
    group of slices at a time) and the reference (plain autograd, log-domain loop); padded
    tokens with a key padding mask, a class token, ``row_normalize=False``."""
    kw = dict(MIXER_CASES[case])
    padded = kw.pop('padded', False)
    group = kw.pop('group_slices', None)
    extra = kw.get('num_extra_tokens', 0)
    if group:
        import linattn_mm.ops.setformer.autograd as scaling
        monkeypatch.setattr(scaling, 'GROUP_BYTES', group * (extra + 63) * 40 * 8)
    torch.manual_seed(0)
    kw = dict(dict(num_refs=40, eps=0.3, tau=0.8), **kw)
    fast = SeTAttention(24, 3, **kw).double()
    ref = SeTAttention(24, 3, core='reference', **kw).double()
    ref.load_state_dict(fast.state_dict())
    assert fast.sinkhorn is scaling_sinkhorn and ref.sinkhorn is log_sinkhorn
    N, B = extra + 7 * 9, 3
    x = torch.randn(B, N, 24, dtype=torch.float64)
    w = torch.randn(B, N, 24, dtype=torch.float64)
    pad = None
    if padded:
        pad = torch.zeros(B, N, dtype=torch.bool)
        pad[1, -11:] = True
        if padded == 'full':
            pad[2] = True  # transported unmasked, outputs zeroed
    grads = []
    for mod in (fast, ref):
        xg = x.clone().requires_grad_()
        y = mod(xg, (7, 9), key_padding_mask=pad)
        # the fast form is the core Function; the reference is plain autograd
        assert ('SelfTransportAttentionBackward' in core_nodes(y)) == (mod is fast)
        (y * w).sum().backward()
        grads.append([y.detach(), xg.grad] + [p.grad for p in mod.parameters()])
    assert len(grads[0]) == 2 + len(list(fast.parameters()))
    for a, b in zip(*grads):
        assert ((a - b).abs().max() / b.abs().max()) < 1e-10
    if padded:
        assert (grads[0][1][1, -11:] == 0).all()


def test_mixer_fast_form_under_autocast_and_in_float32():
    """float32 and bf16 autocast: the fast form's output and gradients within 1e-5 of the
    reference in float32 (the core runs in float32 either way)."""
    torch.manual_seed(0)
    fast = SeTAttention(32, 2, num_refs=60)
    ref = SeTAttention(32, 2, num_refs=60, core='reference')
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(2, 12 * 12, 32)
    results = []
    for mod in (fast, ref):
        xg = x.clone().requires_grad_()
        y = mod(xg, (12, 12))
        y.square().sum().backward()
        results.append([y.detach(), xg.grad] + [p.grad for p in mod.parameters()])
    for a, b in zip(*results):
        assert ((a - b).abs().max() / b.abs().max()) < 1e-5
    with torch.autocast('cpu', dtype=torch.bfloat16):
        y_fast, y_ref = fast(x.bfloat16(), (12, 12)), ref(x.bfloat16(), (12, 12))
    assert y_fast.dtype == y_ref.dtype == torch.float32
    assert ((y_fast - y_ref).abs().max() / y_ref.abs().max()) < 1e-5
    # fp32=False: the projections run in bf16, the core still in float32 (autocast off inside)
    fast.fp32 = False
    xg = x.bfloat16().requires_grad_()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        y_half = fast(xg, (12, 12))
    assert y_half.dtype == torch.bfloat16
    y_half.float().square().sum().backward()
    assert torch.isfinite(xg.grad).all() and xg.grad.abs().sum() > 0
    assert ((y_half.float() - y_ref).abs().max() / y_ref.abs().max()) < 3e-2


def test_slice_groups_do_not_change_the_result(monkeypatch):
    """On CPU the (batch, head) slices run in groups of at most GROUP_BYTES of kernel: one slice
    per group and all slices in one group give the same potentials and gradients (float64,
    1e-12)."""
    import linattn_mm.ops.setformer.autograd as scaling
    torch.manual_seed(2)
    B, h, n, m = 2, 3, 40, 13
    log_k = torch.randn(B, h, n, m, dtype=torch.float64) * 3
    row, col, _ = marginals(B, n, m, torch.float64, pad_rows=4)
    w = torch.randn(B, h, n, m, dtype=torch.float64)
    results = []
    for group_bytes, per_group in ((1, 1), (2 * n * m * 8, 2), (2 ** 30, 6)):
        monkeypatch.setattr(scaling, 'GROUP_BYTES', group_bytes)
        groups = scaling._groups(B * h, n, m, log_k)
        assert [s.stop - s.start for s in groups] == [per_group] * (6 // per_group)
        results.append(run(scaling_sinkhorn, log_k, row, col, 9, w))
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            ok = torch.isfinite(b)
            a, b = torch.where(ok, a, 0.), torch.where(ok, b, 0.)
            assert ((a - b).abs().max() / b.abs().max()) < 1e-12


@pytest.mark.parametrize('position', ['plan', 'kernel', 'both'])
@pytest.mark.parametrize('row_normalize', [True, False])
def test_core_function_gradcheck(position, row_normalize, monkeypatch):
    """:func:`self_transport_attention_fast` alone, float64 gradcheck of the features, the
    references and the values, with padded rows, a positional term and groups of 4 of the 6
    (batch, head) slices (a group of 4 and one of 2)."""
    import linattn_mm.ops.setformer.autograd as scaling
    from linattn_mm.ops.setformer import positional_log_kernel
    torch.manual_seed(0)
    B, h, n, d, m = 2, 3, 6, 4, 5
    monkeypatch.setattr(scaling, 'GROUP_BYTES', 4 * n * m * 8)
    feats = torch.nn.functional.normalize(torch.randn(B, h, n, d, dtype=torch.float64), dim=-1)
    refs = torch.nn.functional.normalize(torch.randn(h, m, d, dtype=torch.float64), dim=-1)
    v = torch.randn(B, h, n, d, dtype=torch.float64)
    row, col, pad = marginals(B, n, m, torch.float64, pad_rows=2)
    valid = ~pad[:, None, :, None]
    scale = ((~pad).sum(-1).double() * m)[:, None, None, None]

    def log_m(dtype):
        return positional_log_kernel((2, 3), m, 0.8, 0, None, dtype)

    def fn(f, r, vv):
        return self_transport_attention_fast(f, r, vv, row, col, valid, scale, 0.5, 0.3, 4,
                                             row_normalize, log_m, position)

    args = (feats.requires_grad_(), refs.requires_grad_(), v.requires_grad_())
    assert torch.autograd.gradcheck(fn, args)
    out = fn(*args)
    assert (out[1, :, -2:] == 0).all()
    # once differentiable: a second derivative is refused, not silently wrong
    g, = torch.autograd.grad(out.square().sum(), args[2], create_graph=True)
    with pytest.raises(RuntimeError, match='once_differentiable'):
        g.sum().backward()
    with pytest.raises(ValueError, match='num_iters'):
        self_transport_attention_fast(*args, row, col, valid, scale, 0.5, 0.3, 0)
    with pytest.raises(ValueError, match='constants'):
        self_transport_attention_fast(*args, row, col.clone().requires_grad_(), valid, scale,
                                      0.5, 0.3, 4)


def test_scaling_form_broadcasts_the_marginals_as_the_log_domain_loop():
    """Marginals with a larger batch than the log-kernel (broadcast): the same potentials and
    log-kernel gradient as the log-domain loop (float64, 1e-10)."""
    torch.manual_seed(3)
    log_k = (torch.randn(3, 5, 4, dtype=torch.float64) * 2)
    row = torch.log_softmax(torch.randn(2, 1, 5, dtype=torch.float64), -1)
    col = torch.full((1, 1, 1), -math.log(4), dtype=torch.float64)
    outs = []
    for fn in (log_sinkhorn, scaling_sinkhorn):
        lk = log_k.clone().requires_grad_()
        f, g = fn(lk, row, col, 6)
        (f.sin().sum() + g.cos().sum()).backward()
        outs.append((f.detach(), g.detach(), lk.grad))
    assert outs[1][0].shape == (2, 3, 5)
    for a, b in zip(*outs):
        assert ((a - b).abs().max() / b.abs().max()) < 1e-10
