"""Training forms of the blocks' FFN halves: autograd Functions that keep for backward only the
block's input (with the LayerNorm statistics) and the ``fc1`` output, and recompute the rest.

Plain autograd of ``fc2(act(fc1(LN(x))))`` keeps the LayerNorm output (``fc1``'s input), the
``fc1`` output (the activation's input) and the activation (``fc2``'s input): C + 2 r C floats a
token for hidden ratio r, and NaLaFormer's ConvFFN ``fc2(h + dwconv(h))`` keeps one more r C map.
These Functions keep x and the ``fc1`` output (r C), and the ConvFFN Function also the LayerNorm
mean and inverse deviation: the normalised input, the activation and the conv branch are
recomputed in the backward, where the gradients are the usual ones written out
(``gelu_backward``, ``native_layer_norm_backward``, ``convolution_backward``). :class:`FFNBranch`
runs over chunks of tokens on CPU, so that no hidden-width map but the kept ``fc1`` output is
made whole (each fresh full-size map costs its page faults and a pass through memory). Under
autocast the products run in the autocast dtype as in the plain form, and the layer norms in
float32 (as autocast runs ``layer_norm`` on CUDA); the backward computes in the dtype of the saved
activations (its layer norm in float32 for a half-precision input) and returns each gradient in
its input's dtype.
"""
import torch
import torch.nn.functional as F

from ..common import (add_or_take, backward_without_autocast, linear_into, promote_types,
                      token_chunk_rows)
from ..common import in_dtype_of as _to

__all__ = ['FFNBranch', 'ConvFFNBranch', 'ffn_branch', 'conv_ffn_branch']


def _ln_input(x):
    """``x`` in the dtype the LayerNorms of these Functions compute in: float32 for a
    half-precision ``x`` (as autocast runs ``layer_norm``; CUDA's kernels also need the input and
    the affine parameters in one dtype), else ``x`` itself."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _layer_norm(x, weight, bias, eps):
    """``(LN(x) in x's dtype, mean, rstd)``, computed as :func:`_ln_input` says."""
    xf = _ln_input(x)
    n, mean, rstd = torch.native_layer_norm(xf, (x.shape[-1], ), _to(weight, xf), _to(bias, xf),
                                            eps)
    return n.to(x.dtype), mean, rstd


def _layer_norm_backward(dn, xf, mean, rstd, weight, bias, mask):
    """``native_layer_norm_backward`` of the input ``xf`` as :func:`_ln_input` gives it (the
    callers make that float32 copy once for both layer-norm passes); the gradients in ``xf``'s
    dtype."""
    return torch.ops.aten.native_layer_norm_backward(
        dn.to(xf.dtype), xf, (xf.shape[-1], ), mean, rstd, _to(weight, xf), _to(bias, xf), mask)


def _linear_grads(grad, inp, weight, need_w, need_b):
    """``grad @ weight`` and the weight / bias gradients of ``y = inp @ weight^T + b`` (2-D)."""
    dt = grad.dtype
    d_in = grad @ weight.to(dt)
    d_w = grad.t() @ inp.to(dt) if need_w else None
    d_b = grad.sum(0) if need_b else None
    return d_in, d_w, d_b


def _ln_backward(ctx, dn, xf, ln_w, ln_b, mean, rstd, first):
    """Gradients of the input ``xf`` (as :func:`_ln_input` gives it) and the LayerNorm's affine
    parameters (inputs ``first``, ``first + 1``, ``first + 2`` of the Function)."""
    need = ctx.needs_input_grad
    return _layer_norm_backward(
        dn, xf, mean, rstd, ln_w, ln_b,
        [need[first], ln_w is not None and need[first + 1], ln_b is not None and need[first + 2]])


class FFNBranch(torch.autograd.Function):
    """``fc2(gelu(fc1(layer_norm(x))))`` over the last dim of ``x`` (..., C), the FFN branch of a
    transformer block without its residual.

    Both passes run over chunks of tokens (:func:`~linattn_mm.ops.common.token_chunk_rows` of
    the hidden width): the forward writes the
    ``fc1`` output (kept for backward) and the result chunk by chunk, and never makes the whole
    activation; the backward recomputes a chunk's LayerNorm output and activation, writes its
    part of the input gradient and accumulates the weight gradients."""

    @staticmethod
    def forward(ctx, x, ln_w, ln_b, eps, w1, b1, w2, b2, approximate, rows=None):
        C = x.shape[-1]
        x2 = x.reshape(-1, C)
        T = x2.shape[0]
        step = token_chunk_rows('FFNBranch', x, w1.shape[0], rows)
        if step >= T:
            h = F.linear(_layer_norm(x2, ln_w, ln_b, eps)[0], w1, b1)
            out = F.linear(F.gelu(h, approximate=approximate), w2, b2)
        else:  # (CPU, float32 / float64, no autocast) each chunk written in place
            h = x2.new_empty(T, w1.shape[0])
            out = x2.new_empty(T, w2.shape[0])
            for i in range(0, T, step):
                h_c = linear_into(_layer_norm(x2[i:i + step], ln_w, ln_b, eps)[0], w1, b1,
                                   h[i:i + step])
                linear_into(F.gelu(h_c, approximate=approximate), w2, b2, out[i:i + step])
        ctx.eps, ctx.approximate, ctx.rows = eps, approximate, step
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        ctx.save_for_backward(x, ln_w, ln_b, w1, w2, h)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad):
        x, ln_w, ln_b, w1, w2, h = ctx.saved_tensors
        need = ctx.needs_input_grad
        C = x.shape[-1]
        x2 = x.reshape(-1, C)
        T = x2.shape[0]
        g2 = grad.reshape(-1, grad.shape[-1])
        dt = grad.dtype
        w1_, w2_ = w1.to(dt), w2.to(dt)
        step = ctx.rows
        # in one chunk the layer norm's input gradient is dx itself (no buffer, no copy)
        dx = torch.empty_like(x2) if need[0] and step < T else None
        acc = dict.fromkeys(('w1', 'b1', 'w2', 'b2', 'lw', 'lb'))
        ln_mask = [need[0], ln_w is not None and need[1], ln_b is not None and need[2]]
        for i in range(0, T, step):
            g_c = g2[i:i + step]
            h_c = h[i:i + step].to(dt)
            if need[6]:
                a_c = F.gelu(h_c, approximate=ctx.approximate)
                acc['w2'] = add_or_take(acc['w2'], g_c.t() @ a_c)
                del a_c
            if need[7] and ctx.has_b2:
                acc['b2'] = add_or_take(acc['b2'], g_c.sum(0))
            dh_c = torch.ops.aten.gelu_backward(g_c @ w2_, h_c, approximate=ctx.approximate)
            del h_c
            x_c = _ln_input(x2[i:i + step])  # one float32 copy of a half-precision chunk
            n_c, mean, rstd = _layer_norm(x_c, ln_w, ln_b, ctx.eps)
            if need[4]:
                acc['w1'] = add_or_take(acc['w1'], dh_c.t() @ n_c.to(dt))
            if need[5] and ctx.has_b1:
                acc['b1'] = add_or_take(acc['b1'], dh_c.sum(0))
            del n_c
            dn_c = dh_c @ w1_
            del dh_c
            dx_c, dlw, dlb = _layer_norm_backward(dn_c, x_c, mean, rstd, ln_w, ln_b, ln_mask)
            if dx is not None:
                dx[i:i + step] = dx_c
            elif need[0]:
                dx = dx_c.to(x.dtype)
            if ln_mask[1]:
                acc['lw'] = add_or_take(acc['lw'], dlw)
            if ln_mask[2]:
                acc['lb'] = add_or_take(acc['lb'], dlb)
        return (None if dx is None else dx.view(x.shape), _to(acc['lw'], ln_w),
                _to(acc['lb'], ln_b), None,
                _to(acc['w1'], w1), _to(acc['b1'], w1), _to(acc['w2'], w2), _to(acc['b2'], w2),
                None, None)


class ConvFFNBranch(torch.autograd.Function):
    """NaLaFormer's ConvFFN branch on a (B, H, W, C) map: ``fc2(h + dwconv(h))`` with
    ``h = gelu(fc1(layer_norm(x)))``, the depth-wise conv (stride 1, same padding) on the
    channels-last (B, r C, H, W) view of ``h``."""

    @staticmethod
    def forward(ctx, x, ln_w, ln_b, eps, w1, b1, dw_w, dw_b, w2, b2, approximate):
        n, mean, rstd = _layer_norm(x, ln_w, ln_b, eps)
        pre = F.linear(n, w1, b1)  # (B, H, W, rC)
        pad = dw_w.shape[-1] // 2
        out = F.linear(_conv_sum(F.gelu(pre, approximate=approximate), dw_w, dw_b, pad), w2, b2)
        ctx.eps, ctx.approximate, ctx.pad = eps, approximate, pad
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        ctx.save_for_backward(x, ln_w, ln_b, mean, rstd, w1, dw_w, dw_b, w2, pre)
        return out

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad):
        x, ln_w, ln_b, mean, rstd, w1, dw_w, dw_b, w2, pre = ctx.saved_tensors
        need = ctx.needs_input_grad
        B, H, W, R = pre.shape
        dt = grad.dtype
        a = F.gelu(pre, approximate=ctx.approximate).to(dt)  # (B, H, W, rC)
        z = _conv_sum(a, dw_w.to(dt), _to(dw_b, a), ctx.pad)
        dz, dw2, db2 = _linear_grads(grad.reshape(-1, grad.shape[-1]), z.reshape(-1, R), w2,
                                     need[8], need[9] and ctx.has_b2)
        del z
        dz = dz.reshape(B, H, W, R)
        # the conv's bias gradient as a sum (the conv backward's own is several times slower)
        d_amap, ddw, _ = torch.ops.aten.convolution_backward(
            dz.permute(0, 3, 1, 2), a.permute(0, 3, 1, 2), dw_w.to(dt), None, [1, 1],
            [ctx.pad, ctx.pad], [1, 1], False, [0, 0], R, [True, need[6], False])
        ddb = dz.sum((0, 1, 2)) if dw_b is not None and need[7] else None
        da = d_amap.permute(0, 2, 3, 1).add_(dz)
        del d_amap, dz, a
        dpre = [torch.ops.aten.gelu_backward(da, pre.to(dt), approximate=ctx.approximate)]
        del da
        dx, dlw, dlb, dw1, db1 = _conv_ffn_input_grads(ctx, x, ln_w, ln_b, mean, rstd, w1, dpre,
                                                       need)
        return (dx, dlw, dlb, None, dw1, db1, _to(ddw, dw_w), _to(ddb, dw_w), _to(dw2, w2),
                _to(db2, w2), None)


def _conv_ffn_input_grads(ctx, x, ln_w, ln_b, mean, rstd, w1, dpre, need):
    """The ConvFFN's gradients from that of the ``fc1`` output, ``dpre`` a list holding it
    (B, H, W, R; taken out, so that it is freed once used): of the input x, the LayerNorm's weight
    and bias, and ``fc1``'s weight and bias, each in its dtype (the LayerNorm output recomputed
    from x and its kept statistics)."""
    dpre = dpre.pop()
    xf = _ln_input(x)  # one float32 copy of a half-precision x for both passes
    n = _layer_norm(xf, ln_w, ln_b, ctx.eps)[0].reshape(-1, x.shape[-1])
    dn, dw1, db1 = _linear_grads(dpre.reshape(-1, dpre.shape[-1]), n, w1, need[4],
                                 need[5] and ctx.has_b1)
    del dpre, n
    dx, dlw, dlb = _ln_backward(ctx, dn.reshape(x.shape), xf, ln_w, ln_b, mean, rstd, 0)
    return _to(dx, x), _to(dlw, ln_w), _to(dlb, ln_b), _to(dw1, w1), _to(db1, w1)


def _conv_sum(a, dw_w, dw_b, pad):
    """``a + dwconv(a)`` of a (B, H, W, R) map, the conv on its channels-last NCHW view; the sum
    (B, H, W, R)-contiguous, as ``fc2`` and its weight gradient read it. Where the conv comes back
    channels-first (a GPU's own depth-wise kernel; ``meta``), the sum is written straight into
    such a buffer: a sum in the conv's layout would be copied again by ``fc2``'s reshape, forward
    and backward (same values either way)."""
    c = F.conv2d(a.permute(0, 3, 1, 2), dw_w, dw_b, 1, pad, 1, dw_w.shape[0]).permute(0, 2, 3, 1)
    if c.is_contiguous() or not a.is_contiguous():
        return c + a
    return torch.add(c, a, out=torch.empty_like(a, dtype=promote_types(c.dtype, a.dtype)))


def ffn_branch(x, norm, mlp):
    """:class:`FFNBranch` with the parameters of a ``nn.LayerNorm`` and an ``Mlp`` (``fc1``,
    GELU, ``fc2``)."""
    return FFNBranch.apply(x, norm.weight, norm.bias, norm.eps, mlp.fc1.weight, mlp.fc1.bias,
                           mlp.fc2.weight, mlp.fc2.bias, mlp.act.approximate)


def conv_ffn_branch(x, norm, ffn):
    """:class:`ConvFFNBranch` on a (B, H, W, C) map with the parameters of a ``nn.LayerNorm`` and
    NaLaFormer's ``ConvFFN`` (``fc1``, GELU, ``dwconv``, ``fc2``)."""
    return ConvFFNBranch.apply(x, norm.weight, norm.bias, norm.eps, ffn.fc1.weight, ffn.fc1.bias,
                               ffn.dwconv.weight, ffn.dwconv.bias, ffn.fc2.weight, ffn.fc2.bias,
                               ffn.act.approximate)
