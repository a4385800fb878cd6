"""Training Functions of small layer compositions around the attention cores, which keep less for
backward than plain autograd and recompute the rest (same values, same gradients):

* :class:`DepthwiseConvTokens` — a depth-wise conv on the grid of (B, N, C) tokens (the Pola
  conv term on ``v``): plain autograd keeps the channels-last copy of the map the conv reads; this
  keeps nothing new (``v`` is a view of the projection output, kept anyway) and makes the copy
  again in the backward.
* :class:`GatedLinear` — ``linear(s * g)`` (Pola's gate and output projection): keeps ``s`` and
  ``g``, not their product.
* :class:`NormGatedLinear` — ``linear(layer_norm(s) * silu(g))`` (NaLa's output): keeps ``s``,
  its LayerNorm statistics and ``g``, not the normalised map, the gate or their product.
* :class:`SplitLinear` — ``linear(x).chunk(parts, -1)`` (the mixers' ``qkvg`` / ``qg`` / ``kv``
  projections): the same forward; its backward takes the parts' gradients one by one, where plain
  autograd first stacks them into one full-width gradient (a fresh (N, parts C) map, the costliest
  copy of a Pola layer's backward on CPU).
* :func:`recomputed` — any function of a mixer that keeps only its inputs and runs once more in
  the backward (PADRe, Poly-SA and SeT, whose polynomial products, pooled terms or transport
  plans are many maps a token but cheap to recompute from the mixer's input).

Under autocast the products run in the autocast dtype as in the plain form; the backward computes
in the dtype of the incoming gradient and returns each gradient in its input's dtype.
"""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ['DepthwiseConvTokens', 'GatedLinear', 'NormGatedLinear', 'SplitLinear', 'split_linear',
           'recomputed',
           'depthwise_weight_grad', 'WEIGHT_GRAD_BANDS']


def recomputed(fn, *args):
    """``fn(*args)``, keeping for backward only the tensors among ``args`` (and the parameters
    ``fn`` reads): the backward runs ``fn`` again under autograd (non-reentrant checkpointing,
    with the random state and autocast of the first run), so the gradients are those of ``fn``.
    Without a gradient it simply runs ``fn``."""
    return checkpoint(fn, *args, use_reentrant=False)


def _to(t, like):
    return None if t is None else t.to(like.dtype)


def _channels_last_map(tokens, hw_shape):
    """(B, N, C) tokens as a contiguous channels-last (B, C, H, W) map."""
    B, N, C = tokens.shape
    H, W = hw_shape
    return tokens.reshape(B, H, W, C).permute(0, 3, 1, 2).contiguous(
        memory_format=torch.channels_last)


#: row bands of :func:`depthwise_weight_grad` (measured on CPU, one thread: 8 bands of a
#: 200 x 336 map, 96 channels, 5 x 5 kernel: 82 ms against 172 ms for the conv backward, the same
#: float32 accuracy; fewer bands lose accuracy, more lose time)
WEIGHT_GRAD_BANDS = 8


def depthwise_weight_grad(grad_map, x_map, kernel_size, padding):
    """The weight gradient of a depth-wise ``k x k`` conv (stride 1, padding ``(k - 1) / 2``) of
    (B, C, H, W) maps: ``dW[c, i, j] = sum_{b,y,x} g[b, c, y, x] x_pad[b, c, y + i, x + j]``,
    computed as a forward depth-wise conv of the padded input with the gradient as its kernel,
    in :data:`WEIGHT_GRAD_BANDS` bands of rows (the channels of every band and image as groups)
    whose (k, k) results are summed (shorter float32 sums). On CPU the conv backward's own weight
    gradient for k >= 5 on channels-last maps is 10-30x slower than the forward conv."""
    B, C, H, W = x_map.shape
    k, p = kernel_size, padding
    R = max(1, min(WEIGHT_GRAD_BANDS, H))
    Hc = -(-H // R)
    xn, gn = x_map.permute(0, 2, 3, 1), grad_map.permute(0, 2, 3, 1)  # (B, H, W, C)
    xp = F.pad(xn, (0, 0, p, p, p, p + Hc * R - H))  # (B, Hc R + 2p, W + 2p, C)
    gp = F.pad(gn, (0, 0, 0, 0, 0, Hc * R - H))  # (B, Hc R, W, C)
    xb = xp.unfold(1, Hc + 2 * p, Hc)  # (B, R, W + 2p, C, Hc + 2p): the bands with their halo
    xb = xb.permute(0, 1, 3, 4, 2).reshape(1, B * R * C, Hc + 2 * p, W + 2 * p)
    gb = gp.view(B, R, Hc, W, C).permute(0, 1, 4, 2, 3).reshape(B * R * C, 1, Hc, W)
    out = F.conv2d(xb, gb, groups=B * R * C)  # (1, B R C, k, k)
    return out.view(B * R, C, k, k).sum(0).unsqueeze(1)


class DepthwiseConvTokens(torch.autograd.Function):
    """``conv2d(map(v), weight, bias, padding, groups=C)`` of (B, H*W, C) tokens, returned as
    (B, H*W, C) tokens (a view of the channels-last output)."""

    @staticmethod
    def forward(ctx, v, hw_shape, weight, bias, padding):
        out = F.conv2d(_channels_last_map(v, hw_shape), weight, bias, padding=padding,
                       groups=v.shape[-1])
        ctx.hw_shape, ctx.padding, ctx.has_bias = tuple(hw_shape), padding, bias is not None
        ctx.save_for_backward(v, weight)
        return out.flatten(2).transpose(1, 2)

    @staticmethod
    def backward(ctx, grad):
        v, weight = ctx.saved_tensors
        B, N, C = v.shape
        H, W = ctx.hw_shape
        dt = grad.dtype
        g_map = grad.reshape(B, H, W, C).permute(0, 3, 1, 2)
        need = ctx.needs_input_grad
        x_map = _channels_last_map(v.to(dt), ctx.hw_shape)
        k = weight.shape[-1]
        banded = (need[2] and k >= 5 and dt == torch.float32 and grad.device.type == 'cpu'
                  and tuple(ctx.padding) == (k // 2, k // 2) and weight.shape[-2] == k)
        # the bias gradient as a sum (the conv backward's own is ~10x slower on CPU)
        dv, dw, _ = torch.ops.aten.convolution_backward(
            g_map, x_map, weight.to(dt), None, [1, 1], list(ctx.padding), [1, 1], False, [0, 0],
            C, [need[0], need[2] and not banded, False])
        if banded:
            dw = depthwise_weight_grad(g_map, x_map, k, k // 2)
        db = grad.sum((0, 1)) if ctx.has_bias and need[3] else None
        if dv is not None:
            dv = dv.permute(0, 2, 3, 1).reshape(B, N, C).to(v.dtype)
        return dv, None, _to(dw, weight), _to(db, weight), None


class GatedLinear(torch.autograd.Function):
    """``linear(s * g, weight, bias)``."""

    @staticmethod
    def forward(ctx, s, g, weight, bias):
        ctx.has_bias = bias is not None
        ctx.save_for_backward(s, g, weight)
        return F.linear(s * g, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        s, g, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        dt = grad.dtype
        C_out = grad.shape[-1]
        g2 = grad.reshape(-1, C_out)
        u = (g2 @ weight.to(dt)).reshape(s.shape)
        ds = (u * g.to(dt)).to(s.dtype) if need[0] else None
        dg = (u * s.to(dt)).to(g.dtype) if need[1] else None
        dw = g2.t() @ (s.to(dt) * g.to(dt)).reshape(-1, s.shape[-1]) if need[2] else None
        db = g2.sum(0) if ctx.has_bias and need[3] else None
        return ds, dg, _to(dw, weight), _to(db, weight)


class NormGatedLinear(torch.autograd.Function):
    """``linear(layer_norm(s) * silu(g), weight, bias)``, the LayerNorm over the last dim."""

    @staticmethod
    def forward(ctx, s, ln_w, ln_b, eps, g, weight, bias):
        n, mean, rstd = torch.native_layer_norm(s, (s.shape[-1], ), ln_w, ln_b, eps)
        ctx.eps, ctx.has_bias = eps, bias is not None
        ctx.save_for_backward(s, ln_w, ln_b, mean, rstd, g, weight)
        return F.linear(n * F.silu(g), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        s, ln_w, ln_b, mean, rstd, g, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        dt = grad.dtype
        C = s.shape[-1]
        n = torch.native_layer_norm(s, (C, ), ln_w, ln_b, ctx.eps)[0].to(dt)
        a = F.silu(g.to(dt))
        g2 = grad.reshape(-1, grad.shape[-1])
        u = (g2 @ weight.to(dt)).reshape(s.shape)
        dw = g2.t() @ (n * a).reshape(-1, C) if need[5] else None
        db = g2.sum(0) if ctx.has_bias and need[6] else None
        dg = torch.ops.aten.silu_backward(u * n, g.to(dt)).to(g.dtype) if need[4] else None
        dn = (u * a).to(s.dtype)
        del u, n, a
        ds, dlw, dlb = torch.ops.aten.native_layer_norm_backward(
            dn, s, (C, ), mean, rstd, ln_w, ln_b,
            [need[0], ln_w is not None and need[1], ln_b is not None and need[2]])
        return ds, dlw, dlb, None, dg, _to(dw, weight), _to(db, weight)


class SplitLinear(torch.autograd.Function):
    """``linear(x, weight, bias)`` split into ``parts`` equal chunks of the last dim (views of
    one output). The backward adds ``grad_i @ W_i`` over the parts that got a gradient and writes
    each part's weight and bias gradient into its rows."""

    @staticmethod
    def forward(ctx, x, weight, bias, parts):
        y = F.linear(x, weight, bias)
        ctx.parts, ctx.has_bias = parts, bias is not None
        ctx.save_for_backward(x, weight)
        return y.unflatten(-1, (parts, y.shape[-1] // parts)).unbind(-2)

    @staticmethod
    def backward(ctx, *grads):
        x, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        C_in = x.shape[-1]
        live = [(i, g.reshape(-1, g.shape[-1])) for i, g in enumerate(grads) if g is not None]
        if not live:
            return None, None, None, None
        dt = live[0][1].dtype
        rows = weight.shape[0] // ctx.parts
        w = weight.to(dt)
        x2 = x.reshape(-1, C_in)
        dx = dw = db = None
        if need[0]:
            for i, g in live:
                w_i = w[i * rows:(i + 1) * rows]
                dx = g @ w_i if dx is None else dx.addmm_(g, w_i)
            dx = dx.view(x.shape).to(x.dtype)
        if need[1] or (ctx.has_bias and need[2]):
            x2 = x2.to(dt)
            dw = torch.zeros_like(weight, dtype=dt) if need[1] else None
            db = torch.zeros(weight.shape[0], dtype=dt, device=weight.device) \
                if ctx.has_bias and need[2] else None
            for i, g in live:
                if dw is not None:
                    torch.mm(g.t(), x2, out=dw[i * rows:(i + 1) * rows])
                if db is not None:
                    torch.sum(g, 0, out=db[i * rows:(i + 1) * rows])
        return dx, _to(dw, weight), _to(db, weight), None


def split_linear(x, linear, parts):
    """:class:`SplitLinear` with the parameters of ``linear``: a tuple of ``parts`` tensors."""
    return SplitLinear.apply(x, linear.weight, linear.bias, parts)
