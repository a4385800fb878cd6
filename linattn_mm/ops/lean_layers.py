"""Training Functions of small layer compositions around the attention cores, which keep less for
backward than plain autograd and recompute the rest (same values, same gradients):

* :class:`DepthwiseConvTokens` — a depth-wise conv on the grid of (B, N, C) tokens (Pola's conv
  term and NaLa's LePE on ``v``): plain autograd keeps the channels-last copy of the map the conv
  reads; this keeps nothing new (``v`` is a view of the projection output, kept anyway) and, on
  CPU, works in bands of rows both ways.
* :class:`GatedLinear` — ``linear(s * g)`` (Pola's gate and output projection): keeps ``s`` and
  ``g``, not their product, and works over chunks of tokens on CPU.
* :class:`NormGatedLinear` — ``linear(layer_norm(s) * silu(g))`` (NaLa's output): keeps ``s``,
  its LayerNorm statistics and ``g``, not the normalised map, the gate or their product.
* :class:`SplitLinear` — ``linear(x).chunk(parts, -1)`` (the mixers' ``qkvg`` / ``qg`` / ``kv``
  projections): the same forward; its backward takes the parts' gradients one by one, where plain
  autograd first stacks them into one full-width gradient (a fresh (N, parts C) map, the costliest
  copy of a Pola layer's backward on CPU).
* :class:`GatherTokens` — tokens rearranged by an index (Swin's padded, shifted windows and
  back): one gather each way, where pad + roll + partition copy the map three times.
* :class:`ScaledAdd` — ``x + b * f``, a residual sum of a branch scaled by a small ``f`` that
  broadcasts over it (a layer scale, a dropped sample's mask and ``1 / keep``): one pass
  forward; the backward writes ``b``'s gradient in ``b``'s dtype in one pass and reduces ``f``'s
  without a full-size product where it can, where plain autograd of the scaled branch and the sum
  makes two or three full-size maps each way (and under autocast a float32 copy of the branch).
* :func:`recomputed` — any function of a mixer that keeps only its inputs and runs once more in
  the backward (PADRe, Poly-SA and SeT, whose polynomial products, pooled terms or transport
  plans are many maps a token but cheap to recompute from the mixer's input).

Under autocast the products run in the autocast dtype as in the plain form; the backward computes
in the dtype of the incoming gradient and returns each gradient in its input's dtype.
"""
import contextlib
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from linattn_mm.utils.autocast_meta import (meta_autocast_as, meta_autocast_dtype,
                                            meta_autocast_enabled)
from .common import (add_or_take, autocast_dtype, backward_without_autocast, kept_input,
                     linear_into, no_autocast, promote_types, token_chunk_rows, token_gram)
from .common import in_dtype_of as _to

__all__ = ['DepthwiseConvTokens', 'depthwise_conv_tokens', 'GatedLinear', 'NormGatedLinear',
           'SplitLinear', 'split_linear', 'ScaledAdd', 'scaled_add',
           'GatherTokens', 'recomputed', 'conv_band_rows', 'conv_backward_form',
           'CONV_BACKWARD_FORMS', 'CONV_BAND_ELEMENTS', 'MIN_BAND_ROWS', 'MAX_BAND_ROWS']


def recomputed(fn, *args):
    """``fn(*args)``, keeping for backward only the tensors among ``args`` (and the parameters
    ``fn`` reads): the backward runs ``fn`` again under autograd (non-reentrant checkpointing,
    with the random state and autocast of the first run; for ``meta`` tensors under
    :func:`~linattn_mm.utils.meta_autocast`, that region's state too), so the gradients are those
    of ``fn``. Without a gradient it simply runs ``fn``."""
    if any(isinstance(a, torch.Tensor) and a.device.type == 'meta' for a in args):
        state = meta_autocast_dtype() if meta_autocast_enabled() else None
        return checkpoint(fn, *args, use_reentrant=False,
                          context_fn=lambda: (contextlib.nullcontext(), meta_autocast_as(state)))
    return checkpoint(fn, *args, use_reentrant=False)


#: rows of one band of :class:`DepthwiseConvTokens` on CPU: between :data:`MIN_BAND_ROWS` and
#: :data:`MAX_BAND_ROWS`, fewer where a band (its rows, of the padded width and the channels of
#: every image) would hold more than :data:`CONV_BAND_ELEMENTS` values. A 200 x 336 map of 96
#: channels, one thread: backward 21 ms in bands of 16 rows (4 rows: 30 ms; 64 rows: 29 ms; the
#: whole map in one conv: 98 ms). The bound on the rows also bounds the float32 sums of the weight
#: gradient (5 x 5 kernel, 200 x 336 map: relative error 1.7e-6 in bands of 16 rows, 7.8e-6 in one)
CONV_BAND_ELEMENTS = 2 ** 19
MIN_BAND_ROWS = 8
MAX_BAND_ROWS = 16


def conv_band_rows(B, H, W, C, pad, device, rows=None):
    """Rows per band of :class:`DepthwiseConvTokens`: ``rows`` if given; on CPU see
    :data:`CONV_BAND_ELEMENTS`; elsewhere the whole map in one band."""
    if rows is None:
        if device.type != 'cpu':
            return H
        rows = CONV_BAND_ELEMENTS // max(B * (W + 2 * pad) * C, 1)
        rows = max(MIN_BAND_ROWS, min(MAX_BAND_ROWS, rows))
    return max(1, min(H, rows))


#: the two backward forms of :class:`DepthwiseConvTokens`
CONV_BACKWARD_FORMS = ('bands', 'aten')


def conv_backward_form(device, form=None):
    """The backward of :class:`DepthwiseConvTokens` on ``device``: ``form`` if given, else
    ``'bands'`` on CPU (the input gradient as a conv of the gradient's bands with the flipped
    kernel, the weight gradient as a forward conv of each band of the input with the gradient band
    as its kernel: on CPU the conv backward's own weight gradient for k >= 5 on channels-last maps
    is 10-30x slower) and ``'aten'`` elsewhere (``aten.convolution_backward`` on the whole map).
    On CUDA the band form's weight gradient is a grouped conv with an image-sized kernel, which
    cuDNN runs with its direct grouped kernel: in a profile of a Pola-Swin-T training step at
    800 x 1344 on an H100 (batch 1, float32), those 4 calls took 67 ms, 54 % of the GPU time, and
    in NaLaFormer-T 12 calls took 77 ms, 62 %; cuDNN's depth-wise weight-gradient kernel took
    47 us a call for NaLaFormer's 3 x 3 ConvFFN in the same profile. With the ``'aten'`` form a
    Pola-Swin-T step on an H200 (same input) took 74.4 ms instead of 141.6 ms
    (``docs/benchmarks.md``, "On a GPU: NVIDIA H200")."""
    if form is None:
        return 'bands' if torch.device(device).type == 'cpu' else 'aten'
    if form not in CONV_BACKWARD_FORMS:
        raise ValueError(f'DepthwiseConvTokens: backward form must be one of '
                         f'{CONV_BACKWARD_FORMS}, got {form!r}')
    return form


class _Bands:
    """Zero-padded row bands of (B, H, W, C) maps: ``fill(src, r0, r1)`` copies rows
    ``r0 - p .. r1 + p`` of ``src`` into a reused (B, r1 - r0 + 2p, W + 2p, C) buffer of
    ``dtype`` (``like``'s if None; the copy casts), with zeros outside the map (the conv's
    padding), and returns it as a channels-last (B, C, ., .) map."""

    def __init__(self, like, rows, pad, dtype=None):
        B, H, W, C = like.shape
        self.H, self.W, self.p = H, W, pad
        self.buf = like.new_zeros(B, rows + 2 * pad, W + 2 * pad, C, dtype=dtype)

    def fill(self, src, r0, r1):
        p, H = self.p, self.H
        b = self.buf[:, :r1 - r0 + 2 * p]
        lo, hi = max(0, r0 - p), min(H, r1 + p)
        top, bottom = lo - (r0 - p), hi - (r0 - p)
        if top:
            b[:, :top].zero_()
        if bottom < b.shape[1]:
            b[:, bottom:].zero_()
        b[:, top:bottom, p:p + self.W] = src[:, lo:hi]
        return b.permute(0, 3, 1, 2)


class DepthwiseConvTokens(torch.autograd.Function):
    """``conv2d(map(v), weight, bias, padding, groups=C)`` of (B, H*W, C) tokens (a square
    ``k x k`` kernel, stride 1, padding ``(k - 1) / 2``), returned as (B, H*W, C) tokens.

    The forward runs over bands of image rows (:func:`conv_band_rows`): each band of ``v`` is
    copied with its halo into one small zero-padded channels-last buffer and convolved there, so
    on CPU no full-size copy of the map is made (off CPU, one band: one padded conv of the
    channels-last view of the map, cast to the weight's dtype); ``v`` (a view of the projection
    output, kept anyway) is all that is kept. The
    backward (:func:`conv_backward_form`, or ``backward_form``) is either ``'bands'``, over the
    same bands: ``dv`` as the conv of the gradient's bands with the flipped kernel and the weight
    gradient as a forward conv of each band of ``v`` with the gradient band as its kernel, the
    bands' (C, k, k) results summed in float64 (in float32 for half-precision gradients); or
    ``'aten'``: one ``aten.convolution_backward`` of the gradient against the channels-last view
    of ``v``. The bias gradient is a sum.

    The conv computes in the dtype of ``weight``; ``v`` may come in a lower precision (Pola's
    half-precision projection under autocast): it is kept as it is, cast band by band (the
    ``'aten'`` backward casts the whole map), and its gradient comes back in its dtype. ``keep``
    (optional): a lower-precision tensor with ``keep.to(v.dtype) == v`` exactly (NaLa's
    half-precision ``v``, whose float32 copy feeds both the LePE and the core, so that its two
    gradients are summed in float32 as in the plain form): it is read and kept instead of ``v``,
    which is then not kept."""

    @staticmethod
    def forward(ctx, v, hw_shape, weight, bias, padding, rows=None, backward_form=None, keep=None):
        ctx.v_dtype, v = v.dtype, kept_input('DepthwiseConvTokens', v, keep)
        B, N, C = v.shape
        H, W = hw_shape
        k = weight.shape[-1]
        if tuple(weight.shape[-2:]) != (k, k) or tuple(padding) != (k // 2, k // 2) or k % 2 == 0:
            raise ValueError(f'DepthwiseConvTokens: needs an odd square kernel with padding '
                             f'k // 2, got {tuple(weight.shape[-2:])} with padding {padding}')
        p = k // 2
        step = conv_band_rows(B, H, W, C, p, v.device, rows)
        src = v.view(B, H, W, C) if v.is_contiguous() else v.reshape(B, H, W, C)
        if step >= H:  # one band: the conv pads (a channels-last map in, one out)
            out = F.conv2d(src.permute(0, 3, 1, 2).to(weight.dtype), weight, bias, padding=p,
                           groups=C).permute(0, 2, 3, 1)
        else:
            bands = _Bands(src, step, p, weight.dtype)
            out = None
            for r0 in range(0, H, step):
                r1 = min(H, r0 + step)
                o = F.conv2d(bands.fill(src, r0, r1), weight, bias, groups=C)  # (B, C, R, W)
                if out is None:  # the conv's dtype (the autocast dtype under autocast)
                    out = o.new_empty(B, H, W, C)
                out[:, r0:r1] = o.permute(0, 2, 3, 1)
        ctx.hw_shape, ctx.rows, ctx.has_bias = (H, W), step, bias is not None
        ctx.form = conv_backward_form(v.device, backward_form)
        ctx.save_for_backward(v, weight)
        return out.reshape(B, N, C)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad):
        v, weight = ctx.saved_tensors
        B, N, C = v.shape
        H, W = ctx.hw_shape
        need = ctx.needs_input_grad
        dt = grad.dtype
        k = weight.shape[-1]
        p, step = k // 2, ctx.rows
        g = grad.reshape(B, H, W, C)
        x = v.reshape(B, H, W, C)
        w = weight.to(dt)
        db = grad.sum((0, 1)) if ctx.has_bias and need[3] else None
        if ctx.form == 'aten':
            dv, dw, _ = torch.ops.aten.convolution_backward(
                g.contiguous().permute(0, 3, 1, 2), x.to(dt).permute(0, 3, 1, 2), w, None, [1, 1],
                [p, p], [1, 1], False, [0, 0], C, [need[0], need[2], False])
            if dv is not None:
                dv = dv.permute(0, 2, 3, 1).reshape(B, N, C).to(ctx.v_dtype)
            return dv, None, _to(dw, weight), _to(db, weight), None, None, None, None
        dv = dw = None
        acc = torch.float64 if dt == torch.float32 else promote_types(dt, torch.float32)
        if need[0]:
            dv = g.new_empty(B, H, W, C)
            w_flip = w.flip(-2, -1)
            g_bands = _Bands(g, step, p)
        if need[2]:
            x_bands = _Bands(x, step, p, dt)
        for r0 in range(0, H, step):
            r1 = min(H, r0 + step)
            if dv is not None:
                dv[:, r0:r1] = F.conv2d(g_bands.fill(g, r0, r1), w_flip, groups=C).permute(
                    0, 2, 3, 1)
            if need[2]:
                xb = x_bands.fill(x, r0, r1)  # (B, C, R + 2p, W + 2p)
                gb = g[:, r0:r1].permute(0, 3, 1, 2)  # (B, C, R, W)
                for b in range(B):  # the band of image b as the kernel of its own channels
                    part = F.conv2d(xb[b:b + 1], gb[b].unsqueeze(1), groups=C)  # (1, C, k, k)
                    dw = part.to(acc) if dw is None else dw.add_(part)
        if dv is not None:
            dv = dv.view(B, N, C).to(ctx.v_dtype)
        if dw is not None:
            dw = dw.view(C, 1, k, k)
        return dv, None, _to(dw, weight), _to(db, weight), None, None, None, None


class GatedLinear(torch.autograd.Function):
    """``linear(s * g, weight, bias)``, over chunks of tokens on CPU
    (:func:`~linattn_mm.ops.common.token_chunk_rows`): the product ``s * g`` and the gradient
    ``grad @ weight`` are made one chunk at a time."""

    @staticmethod
    def forward(ctx, s, g, weight, bias, rows=None):
        C = s.shape[-1]
        s2, g2 = s.reshape(-1, C), g.reshape(-1, C)
        T = s2.shape[0]
        step = token_chunk_rows('GatedLinear', s, s.shape[-1], rows)
        out = None
        for i in range(0, T, step):
            o = F.linear(s2[i:i + step] * g2[i:i + step], weight, bias)
            if step >= T:
                out = o
                break
            if out is None:
                out = o.new_empty(T, o.shape[-1])
            out[i:i + step] = o
        ctx.has_bias, ctx.rows = bias is not None, step
        ctx.save_for_backward(s, g, weight)
        return out.view(*s.shape[:-1], out.shape[-1])

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad):
        s, g, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        dt = grad.dtype
        C, C_out = s.shape[-1], grad.shape[-1]
        g2, s2, gate2 = grad.reshape(-1, C_out), s.reshape(-1, C), g.reshape(-1, C)
        T = g2.shape[0]
        w = weight.to(dt)
        ds = torch.empty_like(s2) if need[0] else None
        dg = torch.empty_like(gate2) if need[1] else None
        dw = db = None
        step = ctx.rows
        for i in range(0, T, step):
            gr = g2[i:i + step]
            s_c, g_c = s2[i:i + step].to(dt), gate2[i:i + step].to(dt)
            if need[0] or need[1]:
                u = gr @ w
                if ds is not None:
                    torch.mul(u, g_c, out=ds[i:i + step])
                if dg is not None:
                    torch.mul(u, s_c, out=dg[i:i + step])
                del u
            if need[2]:
                dw = add_or_take(dw, token_gram(gr, s_c * g_c))
            if ctx.has_bias and need[3]:
                db = add_or_take(db, gr.sum(0))
        return (None if ds is None else ds.view(s.shape),
                None if dg is None else dg.view(g.shape), _to(dw, weight), _to(db, weight), None)


class NormGatedLinear(torch.autograd.Function):
    """``linear(layer_norm(s) * silu(g), weight, bias)``, the LayerNorm over the last dim. The
    gate ``g`` may come in a lower precision than ``s`` (NaLa's half-precision projection under
    autocast): its SiLU is taken in the dtype of ``s``, and it is kept as it is."""

    @staticmethod
    def forward(ctx, s, ln_w, ln_b, eps, g, weight, bias):
        n, mean, rstd = torch.native_layer_norm(s, (s.shape[-1], ), ln_w, ln_b, eps)
        ctx.eps, ctx.has_bias = eps, bias is not None
        ctx.save_for_backward(s, ln_w, ln_b, mean, rstd, g, weight)
        return F.linear(n * F.silu(g.to(n.dtype)), weight, bias)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad):
        s, ln_w, ln_b, mean, rstd, g, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        dt = grad.dtype
        C = s.shape[-1]
        n = torch.native_layer_norm(s, (C, ), ln_w, ln_b, ctx.eps)[0].to(dt)
        a = F.silu(g.to(dt))
        g2 = grad.reshape(-1, grad.shape[-1])
        u = (g2 @ weight.to(dt)).reshape(s.shape)
        dw = token_gram(g2, (n * a).reshape(-1, C)) if need[5] else None
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
    each part's weight and bias gradient into its rows. On CPU both run over chunks of tokens
    (:func:`~linattn_mm.ops.common.token_chunk_rows`): a chunk's GEMMs work in cache (about 15 %
    faster than over the whole map at the widths of a Swin-T stage 1), and no (N, parts * C)
    gradient map is made. In one chunk (off CPU, under autocast, or a map of one chunk) with
    every part's gradient given, the gradients are joined into that map and the backward is one
    GEMM for the input, one product over the tokens for the weight and one sum for the bias, as
    plain autograd's: six operations in all (with the product in parts: a batched GEMM and its
    sum), where each part took eight (``docs/benchmarks.md``, "Operations per training
    step").

    Kept for backward: the input as the product reads it, under autocast its cast to the
    autocast dtype (made here, where autocast would make it inside ``linear``), not the input:
    half the memory of a float32 input, and the weight's gradient takes it as it is where it
    would cast the input again."""

    @staticmethod
    def forward(ctx, x, weight, bias, parts, rows=None):
        C_in = x.shape[-1]
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        x2 = x.reshape(-1, C_in)
        T = x2.shape[0]
        step = token_chunk_rows('SplitLinear', x, x.shape[-1], rows)
        low = autocast_dtype(x.device)
        kept = x
        if low is not None and x.dtype not in (low, torch.float64):
            x2 = kept = x2.to(low)  # autocast's own cast of the input (not of float64)
            step = T  # one chunk, whatever ``rows`` says: the plain form's half-precision sums
        if step >= T:
            y = F.linear(x2, weight, bias)
        else:  # (CPU, float32 / float64, no autocast) each chunk written in place
            y = x2.new_empty(T, weight.shape[0])
            for i in range(0, T, step):
                linear_into(x2[i:i + step], weight, bias, y[i:i + step])
        ctx.parts, ctx.has_bias, ctx.rows = parts, bias is not None, step
        ctx.save_for_backward(kept, weight)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y.unflatten(-1, (parts, y.shape[-1] // parts)).unbind(-2)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, *grads):
        kept, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        x_shape, x_dtype = ctx.x_shape, ctx.x_dtype
        C_in = kept.shape[-1]
        x2 = kept.reshape(-1, C_in)
        live = [(i, g) for i, g in enumerate(grads) if g is not None]
        if not live:
            return None, None, None, None, None
        dt = live[0][1].dtype
        rows = weight.shape[0] // ctx.parts
        w = weight.to(dt)
        T = x2.shape[0]
        want_w = need[1]
        want_b = ctx.has_bias and need[2]
        step = ctx.rows
        if step >= T and len(live) == ctx.parts:  # one chunk: the joined gradient map
            g = torch.cat([g for _, g in live], dim=-1).view(T, -1)  # as plain autograd's
            dx = torch.mm(g, w).view(x_shape).to(x_dtype) if need[0] else None
            dw = token_gram(g, x2.to(dt)) if want_w else None
            db = g.sum(0) if want_b else None
            return dx, _to(dw, weight), _to(db, weight), None, None
        dx = torch.empty(T, C_in, dtype=dt, device=x2.device) if need[0] else None
        dw = torch.zeros_like(weight, dtype=dt) if want_w else None
        db = torch.zeros(weight.shape[0], dtype=dt, device=weight.device) if want_b else None
        live = [(i, g.reshape(T, -1)) for i, g in live]
        for r0 in range(0, T, step):
            x_c = x2[r0:r0 + step].to(dt) if want_w else None
            first = True
            for i, g in live:
                g_c = g[r0:r0 + step]
                part = slice(i * rows, (i + 1) * rows)
                if dx is not None:
                    if first:
                        torch.mm(g_c, w[part], out=dx[r0:r0 + step])
                    else:
                        dx[r0:r0 + step].addmm_(g_c, w[part])
                    first = False
                if want_w:
                    token_gram(g_c, x_c, acc=dw[part])
                if want_b:
                    db[part] += g_c.sum(0)
        if dx is not None:
            dx = dx.view(x_shape).to(x_dtype)
        return dx, _to(dw, weight), _to(db, weight), None, None


def split_linear(x, linear, parts, lean=True):
    """``linear(x)`` as a tuple of ``parts`` equal chunks of the last dim: through
    :class:`SplitLinear` (``lean``, the training form) or plain autograd (the reference)."""
    if lean:
        return SplitLinear.apply(x, linear.weight, linear.bias, parts)
    return linear(x).unflatten(-1, (parts, -1)).unbind(-2)


def depthwise_conv_tokens(v, hw_shape, weight, bias, padding, lean=True, keep=None):
    """The depth-wise conv of (B, H*W, C) tokens on their grid, as (B, H*W, C) tokens in the dtype
    of ``weight``: through :class:`DepthwiseConvTokens` (``lean``, the training form: keeps no
    copy of the map; ``keep``: the lower-precision twin of ``v`` to keep instead) or plain
    autograd of ``conv2d`` on the channels-last view of the tokens (the reference)."""
    if lean:
        return DepthwiseConvTokens.apply(v, tuple(hw_shape), weight, bias, padding, None, None,
                                         keep)
    B, N, C = v.shape
    H, W = hw_shape
    # channels-last strides, no copy (a cast to the weight's dtype, as the lean form computes)
    grid = v.reshape(B, H, W, C).permute(0, 3, 1, 2).to(weight.dtype)
    return F.conv2d(grid, weight, bias, padding=padding, groups=C).flatten(2).transpose(1, 2)


class GatherTokens(torch.autograd.Function):
    """``out[:, j] = src[:, idx[j]]`` of (B, L, C) tokens, and ``fill`` (C, ) (zeros if None)
    where ``idx[j] < 0`` (the positions ``holes``). ``inv`` is the inverse map (``inv[i] = j`` where
    ``idx[j] = i``; -1 at the positions ``inv_holes`` that no ``j`` takes), so the backward is a
    gather too: ``dsrc[:, i] = grad[:, inv[i]]`` (zeros at ``inv_holes``) and ``dfill`` the sum of
    the gradient at ``holes``."""

    @staticmethod
    def forward(ctx, src, idx, holes, inv, inv_holes, fill):
        out = src.index_select(1, idx.clamp_min(0))
        if holes.numel():
            fill_rows = out.new_zeros(()) if fill is None else fill.to(out.dtype)
            out.index_copy_(1, holes, fill_rows.expand(out.shape[0], holes.numel(),
                                                       out.shape[-1]))
        ctx.has_fill = fill is not None
        ctx.save_for_backward(idx, holes, inv, inv_holes)
        return out

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad):
        idx, holes, inv, inv_holes = ctx.saved_tensors
        need = ctx.needs_input_grad
        dsrc = dfill = None
        if need[0]:
            dsrc = grad.index_select(1, inv.clamp_min(0))
            if inv_holes.numel():
                dsrc.index_fill_(1, inv_holes, 0)
        if ctx.has_fill and need[5]:
            dfill = grad.index_select(1, holes).sum((0, 1))
        return dsrc, None, None, None, None, dfill


def _batched_sums(device):
    """Whether :func:`_sum_of_products` sums over trailing dims as a batched product there:
    off CPU."""
    return device.type != 'cpu'


def _sum_of_products(grad, b, shape):
    """``grad * b`` summed over the dims where ``shape`` (that of a factor that broadcasts over
    ``grad`` and ``b``; as many dims or fewer) has size 1, those dims kept. Off CPU, the sums over
    trailing dims of ``grad`` and ``b`` in one dtype, contiguous: one batched product of (1, R)
    rows and (R, 1) columns, no full-size product (then a small sum over the leading dims of size
    1); otherwise the product and its sum (on CPU such a batched product runs at a third of the
    speed of the two passes: 3.5 against 1.0 ms for a (64, 128 x 208) map, one thread)."""
    shape = (1, ) * (grad.dim() - len(shape)) + tuple(shape)
    dims = [i for i, (s, t) in enumerate(zip(shape, grad.shape)) if s == 1 and t != 1]
    last = max([i + 1 for i, s in enumerate(shape) if s != 1] + [0])  # (dynamo: no default=)
    if (dims and dims[-1] >= last and grad.numel() and _batched_sums(grad.device)
            and grad.dtype == b.dtype and grad.is_contiguous() and b.is_contiguous()):
        R = math.prod(grad.shape[last:])
        P = grad.numel() // R
        with no_autocast(grad.device):  # in grad's dtype, as the product and its sum
            out = torch.bmm(grad.view(P, 1, R), b.view(P, R, 1))
        out = out.view(grad.shape[:last] + (1, ) * (grad.dim() - last))
        lead = [i for i in dims if i < last]
        return out.sum(lead, keepdim=True) if lead else out
    return (grad * b).sum(dims, keepdim=True) if dims else grad * b


class ScaledAdd(torch.autograd.Function):
    """``x + b * f``: a branch ``b`` scaled by ``f``, a small tensor that broadcasts over ``b``
    (a layer scale (1, C, 1, 1) or (C, ), a per-sample mask and ``1 / keep``, or their product),
    added to ``x`` of ``b``'s shape; the result in ``out_dtype`` (None: the dtype the three
    promote to). Forward: one ``addcmul``, run with autocast off (autocast would first copy a
    half-precision ``b`` to float32; the kernel reads it as it is and computes in float32 all the
    same). Keeps ``f``, and ``b`` only when ``f`` needs a gradient. Backward: ``x`` gets the
    gradient as it is, ``b`` gets ``grad * f`` written in ``b``'s dtype in one pass, ``f`` the sums
    of ``grad * b`` over its broadcast dims (:func:`_sum_of_products`). Inputs: x, b, f,
    out_dtype."""

    @staticmethod
    def forward(ctx, x, b, f, out_dtype=None):
        with no_autocast(x.device):
            if out_dtype is None or out_dtype == promote_types(
                    promote_types(x.dtype, b.dtype), f.dtype):
                out = torch.addcmul(x, b, f)
            else:  # computed in the promoted dtype, written in out_dtype
                out = torch.addcmul(x, b, f, out=x.new_empty(x.shape, dtype=out_dtype))
        ctx.save_for_backward(b if ctx.needs_input_grad[2] else None, f)
        ctx.b_dtype = b.dtype
        return out

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad):
        b, f = ctx.saved_tensors
        need = ctx.needs_input_grad
        db = None
        if need[1]:  # in b's dtype: written so in one pass when the product has another (not
            # while a graph of the backward is made: out= has no gradient)
            if promote_types(grad.dtype, f.dtype) == ctx.b_dtype:
                db = grad * f
            elif torch.is_grad_enabled():
                db = (grad * f).to(ctx.b_dtype)
            else:
                db = torch.mul(grad, f, out=grad.new_empty(grad.shape, dtype=ctx.b_dtype))
        df = _sum_of_products(grad, b, f.shape) if need[2] else None
        return grad if need[0] else None, db, df, None


def scaled_add(x, b, f, out_dtype=None):
    """``x + b * f`` in ``out_dtype`` (see :class:`ScaledAdd`; ``x`` and ``b`` of one shape, ``f``
    broadcasting over them; other shapes: ``torch.addcmul`` under autograd, autocast off)."""
    if x.shape != b.shape or torch.broadcast_shapes(b.shape, f.shape) != b.shape:
        with no_autocast(x.device):
            out = torch.addcmul(x, b, f)
        return out if out_dtype is None else out.to(out_dtype)
    return ScaledAdd.apply(x, b, f, out_dtype)
