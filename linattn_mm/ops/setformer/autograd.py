"""The fast forms of SeT: the Sinkhorn iteration of :func:`~linattn_mm.ops.setformer.log_sinkhorn`
written in the scaling domain, as an autograd Function of the potentials
(:class:`ScalingSinkhorn`, which keeps the Gibbs kernel and the 4·L vectors of the loop) and inside
one Function of the whole core, from the normalised features to the attention output
(:class:`SelfTransportAttention`, which keeps the features, references, values and the loop's
vectors and recomputes the n x m maps in its backward, one group of slices at a time).

With ``K = exp(log_k - c)`` (``c`` the largest entry of each (batch, head) slice, so that
``K`` lies in ``[exp(-R), 1]`` for a log-kernel of range R), ``a = exp(row)``, ``b = exp(col)``::

    v_0 = 1;   for t = 1..L:   r_t = K v_{t-1},  u_t = a / r_t,  c_t = Kᵀ u_t,  v_t = b / c_t
    f = row - log r_L - c,     g = col - log c_L

which is the log-domain loop ``f = row - lse(log_k + g)``, ``g = col - lse(log_k + f)`` with
``u_t = exp(f_t + c)``, ``v_t = exp(g_t)`` (by induction from ``g_0 = 0``): the same potentials to
rounding, each step two matrix-vector products instead of two log-sum-exps (no exponential in the
loop). Backward (``f̄``, ``ḡ`` the adjoints of ``log u_t``, ``log v_t``; ``ḡ_L`` the output's)::

    for t = L..1:  c̄_t = -ḡ_t / c_t,   f̄_t = u_t (K c̄_t) [+ f̄ of the output at t = L],
                   r̄_t = -f̄_t / r_t,   ḡ_{t-1} = v_{t-1} (Kᵀ r̄_t)
    d log_k = K ⊙ Σ_t (u_t c̄_tᵀ + r̄_t v_{t-1}ᵀ)      (one product of rank 2L),
    d row = Σ_t f̄_t,   d col = Σ_t ḡ_t

``c`` is a constant of the iteration (the potentials do not depend on it), so it has no
gradient. The exponentials cannot under- or overflow when R is moderate: SeT's Gaussian kernel has
``R < 1/eps`` (plus ``1/tau`` with the positional term in the kernel), and the mixer takes this
form only when that bound is at most :data:`MAX_LOG_RANGE` (otherwise the log-domain loop).
Padded rows (``row = -inf``) get ``u = 0`` and no gradient, as in the log domain.
"""
import torch
from torch.autograd.function import once_differentiable

from ..common import backward_without_autocast, core_dtype, grad_needed, no_autocast
from . import self_transport_terms

__all__ = ['ScalingSinkhorn', 'scaling_sinkhorn', 'SelfTransportAttention',
           'self_transport_attention_fast', 'MAX_LOG_RANGE', 'GROUP_BYTES']

#: the largest log-kernel range (max - min per slice) for which the scaling form is used: its
#: entries are then >= exp(-30) ~ 1e-13, far from the float32 limits, and so are the scalings.
MAX_LOG_RANGE = 30.


def _vm(vec, mat):
    """``vecᵀ mat`` for (..., n) and (..., n, m): a row vector times the matrix, the fastest of
    the batched matrix-vector forms on CPU (for a (2, 16384, 750) kernel: ``mat @ vec`` 4x and
    ``matᵀ @ vec`` 11x slower there)."""
    return (vec.unsqueeze(-2) @ mat).squeeze(-2)


#: on CPU the (batch, head) slices run in groups whose kernels total at most this many bytes, so
#: that a group stays in the last-level cache across the 2·L passes of its loop (a 4200 x 750 slice,
#: SeTformer-T's stage 3 at 800x1344: the loop 1.8x faster than over all slices at once); on CUDA
#: all slices run at once.
GROUP_BYTES = 16 * 2 ** 20


def _groups(G, n, m, like):
    """Slices of the flattened (batch, head) index of G slices of n x m kernels of ``like``'s
    dtype and device, one per group (see :data:`GROUP_BYTES`)."""
    if like.device.type != 'cpu':
        return [slice(0, G)]
    size = max(1, GROUP_BYTES // max(1, n * m * like.element_size()))
    return [slice(i, min(i + size, G)) for i in range(0, G, size)]


def _loop(kern, a, b, num_iters, keep):
    """The scaling loop on (G, n, m) kernels; with ``keep`` also the stacks (G, ., L) of u_t,
    r_t, c_t and v_{t-1}."""
    v = kern.new_ones(kern.shape[:-2] + kern.shape[-1:])
    kt = kern.transpose(-2, -1)
    saved = ([], [], [], []) if keep else None
    for _ in range(num_iters):
        r = _vm(v, kt)
        u = a / r
        c = _vm(u, kern)
        if keep:
            for lst, t in zip(saved, (u, r, c, v)):
                lst.append(t)
        v = b / c
    stacks = tuple(torch.stack(lst, -1) for lst in saved) if keep else None
    return r, c, stacks


def _reverse(kern, stacks, fbar, gbar, want_k, acc=None):
    """The loop in reverse on (G, n, m) kernels (module docstring): ``d log_k`` (or None; added
    in place to ``acc`` when given), the summed adjoints of ``log u_t`` (d row) and of
    ``log v_t`` (d col)."""
    us, rs, cs, vs = stacks
    L = us.shape[-1]
    kt = kern.transpose(-2, -1)
    d_row, d_col = torch.zeros_like(rs[..., 0]), torch.zeros_like(cs[..., 0])
    left, right = [], []  # the rank-2L factors of d K: Σ left_i right_iᵀ
    for t in reversed(range(L)):
        u, r, c, v_prev = us[..., t], rs[..., t], cs[..., t], vs[..., t]
        if gbar is None:
            cbar = torch.zeros_like(c)
        else:
            d_col += gbar
            cbar = -gbar / c
        fb = u * _vm(cbar, kt)
        if t == L - 1 and fbar is not None:
            fb += fbar
        d_row += fb
        rbar = -fb / r
        left += [u, rbar]
        right += [cbar, v_prev]
        gbar = v_prev * _vm(rbar, kern) if t else None
    d_log_k = None
    if want_k:
        d_log_k = torch.stack(left, -1) @ torch.stack(right, -2)
        d_log_k = d_log_k.mul_(kern) if acc is None else acc.addcmul_(d_log_k, kern)
    return d_log_k, d_row, d_col


def _flat(t, batch, last):
    """``t`` broadcast to ``batch + (last,)`` and flattened to (G, last)."""
    return t.expand(batch + (last, )).reshape(-1, last)


class ScalingSinkhorn(torch.autograd.Function):
    """``(f, g)`` of :func:`~linattn_mm.ops.setformer.log_sinkhorn` by the scaling loop of the
    module docstring. Inputs: log_k (..., n, m), row (..., n) and col (..., m) log marginals
    (broadcastable), num_iters. Half-precision inputs are computed in float32. The (batch, head)
    slices run in groups (:data:`GROUP_BYTES`); the result does not depend on the grouping."""

    @staticmethod
    def forward(ctx, log_k, row, col, num_iters, keep):
        work = log_k.dtype if log_k.dtype in (torch.float32, torch.float64) else torch.float32
        n, m = log_k.shape[-2:]
        batch = torch.broadcast_shapes(log_k.shape[:-2], row.shape[:-1], col.shape[:-1])
        lk = log_k.to(work).expand(batch + (n, m)).reshape(-1, n, m)
        shift = lk.amax(dim=(-2, -1))  # (G,)
        kern = (lk - shift[:, None, None]).exp_()
        row_w, col_w = _flat(row.to(work), batch, n), _flat(col.to(work), batch, m)
        a, b = row_w.exp(), col_w.exp()
        r, c = torch.empty_like(row_w), torch.empty_like(col_w)
        stacks = tuple(kern.new_empty((kern.shape[0], size, num_iters)) for size in (n, n, m, m)) \
            if keep else None
        for sl in _groups(*kern.shape, kern):
            r[sl], c[sl], part = _loop(kern[sl], a[sl], b[sl], num_iters, keep)
            if keep:
                for dst, src in zip(stacks, part):
                    dst[sl] = src
        f = (row_w - r.log() - shift[:, None]).reshape(batch + (n, ))
        g = (col_w - c.log()).reshape(batch + (m, ))
        if keep:
            ctx.shapes = (log_k.shape, log_k.dtype, row.shape, col.shape)
            ctx.batch = batch
            ctx.save_for_backward(kern, *stacks)
        return f.to(log_k.dtype), g.to(log_k.dtype)

    @staticmethod
    @once_differentiable
    @backward_without_autocast
    def backward(ctx, grad_f, grad_g):
        kern, *stacks = ctx.saved_tensors
        shape, dtype, row_shape, col_shape = ctx.shapes
        G, n, m = kern.shape
        fbar = None if grad_f is None else grad_f.to(kern.dtype).reshape(G, n)
        gbar = None if grad_g is None else grad_g.to(kern.dtype).reshape(G, m)
        want_k = ctx.needs_input_grad[0]
        d_log_k = torch.empty_like(kern) if want_k else None
        d_row, d_col = kern.new_empty(G, n), kern.new_empty(G, m)
        for sl in _groups(*kern.shape, kern):
            dk, d_row[sl], d_col[sl] = _reverse(
                kern[sl], [t[sl] for t in stacks], None if fbar is None else fbar[sl],
                None if gbar is None else gbar[sl], want_k)
            if want_k:
                d_log_k[sl] = dk
        batch = kern_batch = ctx.batch
        if want_k:
            d_log_k = d_log_k.reshape(kern_batch + shape[-2:]).sum_to_size(shape).to(dtype)
        d_row = d_row.reshape(batch + (n, )).sum_to_size(row_shape) \
            if ctx.needs_input_grad[1] else None
        d_col = d_col.reshape(batch + (m, )).sum_to_size(col_shape) \
            if ctx.needs_input_grad[2] else None
        return d_log_k, d_row, d_col, None, None


def scaling_sinkhorn(log_k, row_log_marginal, col_log_marginal, num_iters):
    """:func:`~linattn_mm.ops.setformer.log_sinkhorn` (same arguments and result) by the scaling
    loop of :class:`ScalingSinkhorn`, for log-kernels of range at most :data:`MAX_LOG_RANGE`."""
    if num_iters < 1:
        raise ValueError(f'scaling_sinkhorn: num_iters must be >= 1, got {num_iters}')
    keep = grad_needed(log_k, row_log_marginal, col_log_marginal)
    return ScalingSinkhorn.apply(log_k, row_log_marginal, col_log_marginal, num_iters, keep)


# -------------------------------------------------------------------------------------------------
# the whole core: kernel, Sinkhorn, plan and the self-kernel attention in one Function
# -------------------------------------------------------------------------------------------------
class SelfTransportAttention(torch.autograd.Function):
    """SeT's core from the normalised features to the attention output, for the Gaussian kernel,
    in the scaling domain, over groups of (batch, head) slices (:data:`GROUP_BYTES`)::

        S = exp((F Rᵀ - 1) / σ²),  log_k = S / eps [+ log M],  (u, v) = scaling loop,
        T = u ⊙ exp(log_k - c) ⊙ vᵀ [⊙ M],  [num | den] = T (Tᵀ [V | 1]),  out = num / den

    (``[+ log M]`` for the positional term in the kernel, ``[⊙ M]`` on the plan; ``out = num ·
    scale`` without the row normalisation; padded rows 0). It keeps for backward F, R, V and the
    4·L vectors of the loop; the backward recomputes S, the kernel and the plan of one group at a
    time and runs the loop in reverse, so the n x m maps exist for one group only, in the forward as
    in the backward, and the loop runs once each way (a recomputed mixer runs it twice forward).

    Inputs: feats (B, h, n, d) and refs (h, m, d) unit vectors, v (B, h, n, d), row (B or 1, 1, n
    or 1) and col (1, 1, 1) log marginals, valid (B, 1, n, 1) bool or None, scale (tensor
    broadcastable to (B, 1, 1, 1) or float; used when ``opts['row_normalize']`` is False), opts:
    ``sigma``, ``eps``, ``num_iters``, ``row_normalize``, ``log_m`` (a callable giving log M (n, m)
    in a dtype, or None) and ``position`` (``'kernel'``, ``'plan'`` or ``'both'``).
    """

    @staticmethod
    def forward(ctx, feats, refs, v, row, col, valid, scale, opts):
        with no_autocast(feats.device):
            return SelfTransportAttention._forward(ctx, feats, refs, v, row, col, valid, scale,
                                                   opts)

    @staticmethod
    def _forward(ctx, feats, refs, v, row, col, valid, scale, opts):
        B, h, n, d = feats.shape
        m = refs.shape[-2]
        G = B * h
        F = feats.reshape(G, n, d)
        R = refs.expand(B, h, m, d).reshape(G, m, d)
        V = v.reshape(G, n, -1)
        a = _flat(row, (B, h), n).exp()
        b = _flat(col, (B, h), m).exp()
        mask = None if valid is None else valid.expand(B, h, n, 1).reshape(G, n, 1)
        scl = None if opts['row_normalize'] else \
            torch.as_tensor(scale, dtype=F.dtype, device=F.device).expand(B, h, 1, 1).reshape(
                G, 1, 1)
        log_m = None if opts['log_m'] is None else opts['log_m'](F.dtype)
        keep = opts['keep']
        out = V.new_empty(G, n, V.shape[-1])
        stacks = tuple(F.new_empty((G, size, opts['num_iters'])) for size in (n, n, m, m)) \
            if keep else None
        for sl in _groups(G, n, m, F):
            S, kern = _set_kernel(F[sl], R[sl], log_m, opts)
            r, c, part = _loop(kern, a[sl], b[sl], opts['num_iters'], keep)
            plan = _set_plan(kern, a[sl] / r, b[sl] / c, log_m, opts)
            del S, kern
            out[sl] = self_transport_terms(plan, V[sl], scl is None,
                                           None if scl is None else scl[sl],
                                           None if mask is None else mask[sl])[0]
            if keep:
                for dst, src in zip(stacks, part):
                    dst[sl] = src
        if keep:
            ctx.opts, ctx.shape = opts, (B, h, n, d, m)
            ctx.save_for_backward(feats, refs, v, col, valid, scl, *stacks)
        return out.reshape(B, h, n, -1)

    @staticmethod
    @once_differentiable
    @backward_without_autocast  # float32 products, whatever the caller's autocast
    def backward(ctx, grad):
        feats, refs, v, col, valid, scl, *stacks = ctx.saved_tensors
        opts = ctx.opts
        B, h, n, d, m = ctx.shape
        G = B * h
        F = feats.reshape(G, n, d)
        R = refs.expand(B, h, m, d).reshape(G, m, d)
        V = v.reshape(G, n, -1)
        b = _flat(col, (B, h), m).exp()
        mask = None if valid is None else valid.expand(B, h, n, 1).reshape(G, n, 1)
        log_m = None if opts['log_m'] is None else opts['log_m'](F.dtype)
        dout = grad.reshape(G, n, -1).to(F.dtype)
        need_f, need_r, need_v = ctx.needs_input_grad[:3]
        dF = torch.zeros_like(F) if need_f else None
        dR = torch.zeros_like(R) if need_r else None
        dV = torch.empty_like(V) if need_v else None
        for sl in _groups(G, n, m, F):
            part = [t[sl] for t in stacks]
            us, rs, cs = part[0], part[1], part[2]
            S, kern = _set_kernel(F[sl], R[sl], log_m, opts)
            u_last, v_last = us[..., -1], b[sl] / cs[..., -1]
            plan = _set_plan(kern, u_last, v_last, log_m, opts)
            msk = None if mask is None else mask[sl]
            _, z, num, den = self_transport_terms(plan, V[sl], scl is None,
                                                  None if scl is None else scl[sl], msk)
            # out = num / den (row-normalised) or num * scale; padded rows 0
            go = dout[sl] if msk is None else dout[sl] * msk
            if opts['row_normalize']:
                dnum = go / den
                dden = -(go * num).sum(-1, keepdim=True) / (den * den)
                if msk is not None:
                    dden = dden * msk
            else:
                dnum = go * scl[sl]
                dden = torch.zeros_like(den)
            dO = torch.cat([dnum, dden], -1)  # (g, n, d + 1)
            dz = plan.transpose(-2, -1) @ dO  # (g, m, d + 1)
            if need_v:
                dV[sl] = plan @ dz[..., :-1]
            if not (need_f or need_r):
                continue
            # d plan = dO zᵀ + [V | 1] dzᵀ; E = d plan ⊙ plan is the gradient of its exponent
            e = (dO @ z.transpose(-2, -1)).baddbmm_(V[sl], dz[..., :-1].transpose(-2, -1))
            e.add_(dz[..., -1].unsqueeze(-2)).mul_(plan)
            del plan
            # the plan's own log_k term (e) plus the loop's
            d_lk, _, _ = _reverse(kern, part, e.sum(-1), e.sum(-2), True, acc=e)
            del e, kern
            dp = d_lk.div_(opts['eps']).mul_(S).div_(opts['sigma'] ** 2)  # d (F Rᵀ)
            del S
            if need_f:
                dF[sl] = dp @ R[sl]
            if need_r:
                dR[sl] = dp.transpose(-2, -1) @ F[sl]
        dF = None if dF is None else dF.reshape(B, h, n, d)
        dR = None if dR is None else dR.reshape(B, h, m, d).sum(0)
        dV = None if dV is None else dV.reshape(v.shape)
        return dF, dR, dV, None, None, None, None, None


def _set_kernel(F, R, log_m, opts):
    """``S = exp((F Rᵀ - 1)/σ²)`` and the scaled Gibbs kernel ``exp(log_k - c)`` (``c`` the
    largest entry of each slice)."""
    S = (F @ R.transpose(-2, -1)).sub_(1.).div_(opts['sigma'] ** 2).exp_()
    log_k = S / opts['eps']
    if log_m is not None and opts['position'] in ('kernel', 'both'):
        log_k += log_m
    shift = log_k.amax(dim=(-2, -1), keepdim=True)
    return S, log_k.sub_(shift).exp_()


def _set_plan(kern, u, v, log_m, opts):
    """``T = u ⊙ kern ⊙ vᵀ`` [⊙ M on the plan, as ``exp(log M + log u + log v) ⊙ kern``: one new
    map]."""
    if log_m is not None and opts['position'] in ('plan', 'both'):
        return (log_m + u.log().unsqueeze(-1) + v.log().unsqueeze(-2)).exp_().mul_(kern)
    return kern * u.unsqueeze(-1) * v.unsqueeze(-2)


def self_transport_attention_fast(feats, refs, v, row, col, valid, scale, sigma, eps, num_iters,
                                  row_normalize=True, log_m=None, position='plan'):
    """SeT's core (Gaussian kernel, scaling-domain Sinkhorn) by :class:`SelfTransportAttention`:
    the attention output (B, h, n, d) of the module's reference path
    (``self_transport_attention(transport_plan(...), v, ...)``) to rounding, in float32 (float64
    for float64 inputs) with autocast off."""
    if not (isinstance(num_iters, int) and num_iters >= 1):
        raise ValueError(f'self_transport_attention_fast: num_iters must be an int >= 1, got '
                         f'{num_iters!r}')
    if grad_needed(row, col, scale):
        raise ValueError('self_transport_attention_fast: the marginals and the scale are '
                         'constants here (no gradient); use the reference path to differentiate '
                         'them')
    work = core_dtype(feats, refs, v)
    keep = grad_needed(feats, refs, v)
    feats, refs, v = feats.to(work), refs.to(work), v.to(work)
    row, col = row.to(work), col.to(work)
    opts = dict(sigma=float(sigma), eps=float(eps), num_iters=num_iters,
                row_normalize=bool(row_normalize), log_m=log_m, position=position, keep=keep)
    return SelfTransportAttention.apply(feats, refs, v, row, col, valid, scale, opts)
