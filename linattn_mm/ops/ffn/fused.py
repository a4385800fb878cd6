"""Fused training forms of NaLaFormer's blocks (CUDA; a block's ``ffn_core='fused'``): the
ConvFFN's ``h + dwconv(h)`` and the CPE's ``x + cpe(x)``, each one Triton kernel forward and one
backward, and the backward of the residual sums with their LayerScale as one more
(:class:`ScaledAddFused`).

A NaLaFormer block adds a depth-wise 3×3 conv to its own input three times: the two CPEs on the
C-wide map and the ConvFFN's conv on the 4C-wide hidden map. In torch each sum is a conv, then an
add, and under autocast a cast of the input first; backward the same passes again with the conv's
input gradient and the gradient's add. On a GPU these passes are bytes moved and nothing else
(docs/benchmarks.md, "Operations and memory per training step"). Here each sum is one kernel that
reads its input once (the taps of the 3×3 window come from the cache) and writes the sum once:

* **Forward**: ``z = x + round(Σ_ij w_ij · round(x)[y+i-1, x+j-1] + b)``, where ``round`` is the
  cast to the dtype autocast runs the conv in (none in float32), so that the result is the one of
  the plain modules up to the order of the conv's float32 sums.
* **Backward**: the conv's input gradient is the same window sum with the kernel flipped,
  ``dx = g + round(Σ_ij w_(K-1-i)(K-1-j) · round(g)[y+i-1, x+j-1])``; in the ConvFFN it is then
  multiplied by ``gelu'(pre)`` (the GELU before the conv; exact ``erf`` form) in the same kernel,
  which so writes the gradient of the ``fc1`` output. The conv's weight gradient is cuDNN's
  (``convolution_backward`` with only its weight output), its bias gradient a sum.

What is kept for backward does not change: the ConvFFN keeps its input, the LayerNorm statistics
and the ``fc1`` output (:class:`~linattn_mm.ops.ffn.autograd.ConvFFNBranch`, whose LayerNorm and
products these Functions share); the CPE keeps its input in the conv's dtype where its weight
needs a gradient (the copy autocast's conv keeps, here written by the forward kernel). On CPU
tensors the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests
check them without a GPU; on ``meta`` tensors each launch is one operation that reads its
inputs and writes its output, so the counters of :mod:`linattn_mm.utils` count them.
"""
import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..common import autocast_dtype, backward_without_autocast, promote_types
from ..common import in_dtype_of as _to
from ..dispatch import (TRITON_DTYPES, fused_chunks, fused_warps, launch_fitted,
                        triton_available, triton_module)
from ..lean_layers import ScaledAdd, scaled_add
from .autograd import _conv_ffn_input_grads, _layer_norm, _linear_grads

triton = triton_module()
if triton is not None:
    import triton.language as tl

__all__ = ['conv_sum', 'ConvFFNBranchFused', 'ConvResidualFused', 'conv_ffn_branch_fused',
           'conv_residual_fused', 'check_fused_conv', 'ScaledAddFused', 'scaled_add_fused']

#: ``round`` of the module docstring: the dtype code the kernels cast to and back (0: none)
_ROUNDING = {torch.bfloat16: 1, torch.float16: 2}
#: elements of one program's tile (channels by columns); under Triton's interpreter, at most
_TILE = 1024
_INTERPRETED_TILE = 1 << 15
#: tokens and channels of a tile of the residual sums' gradient kernel
_ADD_TOKENS, _ADD_CHANNELS = 64, 16

if triton is not None:

    @triton.jit
    def _round(x, ROUND: tl.constexpr):
        """Float32 ``x`` rounded to bfloat16 (ROUND 1) or float16 (2), to nearest even, back in
        float32; bfloat16 on the bits (Triton's interpreter casts to it by truncation), a NaN
        kept a NaN (quiet, so that the truncating cast keeps it one too)."""
        if ROUND == 1:
            u = x.to(tl.uint32, bitcast=True)
            u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
            x = tl.where(x != x, x + x, u.to(tl.float32, bitcast=True))
        elif ROUND == 2:
            x = x.to(tl.float16).to(tl.float32)
        return x

    @triton.jit
    def _conv_sum_kernel(X, Wt, Bias, PRE, Z, XC, H, Wd, C,
                         s_xb, s_xh, s_xw, s_xc, s_pb, s_ph, s_pw, s_pc, s_zb, s_zh, s_zw, s_zc,
                         K: tl.constexpr, FLIP: tl.constexpr, HAS_BIAS: tl.constexpr,
                         COPY: tl.constexpr,
                         GELU_GRAD: tl.constexpr, ROUND: tl.constexpr, ROUND_OUT: tl.constexpr,
                         BW: tl.constexpr, BC: tl.constexpr):
        row = tl.program_id(0)  # image b, row y
        b = (row // H).to(tl.int64)
        y = row % H
        rw = tl.program_id(1) * BW + tl.arange(0, BW)
        rc = tl.program_id(2) * BC + tl.arange(0, BC)
        cm = rc < C
        cm2 = cm[None, :]
        xb = X + b * s_xb
        tile = rw[:, None] * s_xw + rc[None, :] * s_xc  # the tile's offsets in a row
        wc = Wt + rc * (K * K)  # each channel's K x K taps
        acc = tl.zeros((BW, BC), dtype=tl.float32)
        for i in tl.static_range(K):  # the taps in the conv's order: rows, then columns
            yy = y + (i - K // 2)
            row = xb + yy * s_xh + tile
            row_in = (yy >= 0) & (yy < H)
            for j in tl.static_range(K):
                xx = rw + (j - K // 2)
                m = ((xx >= 0) & (xx < Wd))[:, None] & cm2 & row_in
                t = tl.load(row + (j - K // 2) * s_xw, mask=m, other=0.0).to(tl.float32)
                if ROUND != 0:  # (a call less per tap in Triton's interpreter)
                    t = _round(t, ROUND)
                if FLIP:
                    tap = (K - 1 - i) * K + (K - 1 - j)
                else:
                    tap = i * K + j
                acc += t * tl.load(wc + tap, mask=cm, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(Bias + rc, mask=cm, other=0.0).to(tl.float32)[None, :]
        if ROUND != 0:
            acc = _round(acc, ROUND)
        mo = (rw < Wd)[:, None] & cm2
        center = tl.load(xb + y * s_xh + tile, mask=mo, other=0.0).to(tl.float32)
        out = b * s_zb + y * s_zh + rw[:, None] * s_zw + rc[None, :] * s_zc
        if COPY:  # the conv's input as autocast casts it (the weight gradient reads it)
            tl.store(XC + out, _round(center, ROUND).to(XC.dtype.element_ty), mask=mo)
        z = center + acc
        if GELU_GRAD:  # z * gelu'(pre), gelu'(p) = Phi(p) + p phi(p)
            if ROUND != 0:
                z = _round(z, ROUND)
            p = tl.load(PRE + b * s_pb + y * s_ph + rw[:, None] * s_pw + rc[None, :] * s_pc,
                        mask=mo, other=0.0).to(tl.float32)
            z = z * (0.5 * (1.0 + tl.math.erf(p * 0.7071067811865476))
                     + p * tl.exp(-0.5 * p * p) * 0.3989422804014327)
        tl.store(Z + out, _round(z, ROUND_OUT).to(Z.dtype.element_ty), mask=mo)

    @triton.jit
    def _scaled_add_grads_kernel(G, Bm, F, DB, S, L, C, chunk,
                                 s_gb, s_gt, s_gc, s_bb, s_bt, s_bc, s_db, s_dt, s_dc, s_fb, s_fc,
                                 NEED_DB: tl.constexpr, NEED_DF: tl.constexpr,
                                 ROUND_OUT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        rc = tl.program_id(0) * BC + tl.arange(0, BC)
        split = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)  # image
        cm = rc < C
        f = tl.load(F + b * s_fb + rc * s_fc, mask=cm, other=0.0).to(tl.float32)[None, :]
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for off in range(0, chunk, BT):
            rt = split * chunk + off + tl.arange(0, BT)
            m = (rt < L)[:, None] & cm[None, :]
            g = tl.load(G + b * s_gb + rt[:, None] * s_gt + rc[None, :] * s_gc, mask=m,
                        other=0.0).to(tl.float32)
            if NEED_DB:
                tl.store(DB + b * s_db + rt[:, None] * s_dt + rc[None, :] * s_dc,
                         _round(g * f, ROUND_OUT).to(DB.dtype.element_ty), mask=m)
            if NEED_DF:
                acc += g * tl.load(Bm + b * s_bb + rt[:, None] * s_bt + rc[None, :] * s_bc,
                                   mask=m, other=0.0).to(tl.float32)
        if NEED_DF:
            tl.store(S + (b * tl.num_programs(1) + split) * C + rc, tl.sum(acc, axis=0), mask=cm)


def _tile(x):
    """(columns, channels) of a program's tile: the map's contiguous dim the longer one. Triton's
    interpreter runs a program's tile as numpy arrays and each program in Python: there the tiles
    are up to :data:`_INTERPRETED_TILE` elements, so that a map takes few programs."""
    if os.environ.get('TRITON_INTERPRET') == '1':
        channels = min(256, max(16, triton.next_power_of_2(x.shape[-1])))
        return max(16, min(triton.next_power_of_2(x.shape[2]),
                           _INTERPRETED_TILE // channels)), channels
    channels = 16 if x.stride(-1) != 1 else \
        min(64, max(16, triton.next_power_of_2(x.shape[-1])))  # NCHW: the columns contiguous
    return _TILE // channels, channels


def _sum_outputs(x, out_dtype, copy):
    # x's strides (NHWC, or a view of NCHW); the copy in the conv's dtype, or nothing
    conv_dtype = x.dtype if copy is None else copy
    return (torch.empty_like(x, dtype=out_dtype),
            x.new_empty(0) if copy is None else torch.empty_like(x, dtype=conv_dtype))


@torch.library.custom_op('linattn_mm::conv_sum', mutates_args=())
def _conv_sum_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 pre: Optional[torch.Tensor], flip: bool, rounding: int, out_dtype: torch.dtype,
                 copy: Optional[torch.dtype]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x + dwconv(x)`` of a (B, H, W, C) map (any strides; the result has x's) with the
    depth-wise kernel ``weight`` (C, 1, K, K) (flipped: the conv's input gradient) and ``bias``;
    times ``gelu'(pre)`` when ``pre`` is given; ``rounding``: the code of :data:`_ROUNDING`; with
    ``copy`` (a dtype) also x rounded to it, else an empty tensor."""
    B, H, W, C = x.shape
    z, xc = _sum_outputs(x, out_dtype, copy)
    bw, bc = _tile(x)
    k = weight.shape[-1]
    pre_t = x if pre is None else pre
    launch_fitted(_conv_sum_kernel, (B * H, triton.cdiv(W, bw), triton.cdiv(C, bc)),
        x, weight, weight if bias is None else bias, pre_t, z, z if copy is None else xc, H, W,
        C, *x.stride(), *pre_t.stride(), *z.stride(), num_warps=fused_warps(), K=k, FLIP=flip,
        HAS_BIAS=bias is not None, COPY=copy is not None, GELU_GRAD=pre is not None,
        ROUND=rounding, ROUND_OUT=_ROUNDING.get(out_dtype, 0), BW=bw, BC=bc)
    return z, xc


@_conv_sum_op.register_fake
def _(x, weight, bias, pre, flip, rounding, out_dtype, copy):
    return _sum_outputs(x, out_dtype, copy)


def conv_sum(x, weight, bias=None, pre=None, flip=False, conv_dtype=None, out_dtype=None,
             copy=False):
    """``x + dwconv(x)`` of a (B, H, W, C) map ``x`` (module docstring): the depth-wise ``weight``
    (C, 1, K, K), odd K, same padding, and ``bias`` (C) or None, with the conv run as in
    ``conv_dtype`` (its input, weights and output in that dtype; default x's), the result in
    ``out_dtype`` (default x's) with x's strides. ``flip``: the kernel flipped (the conv's input
    gradient); ``pre``: the result times ``gelu'(pre)`` (a map of x's shape). ``copy``: return
    ``(result, x in conv_dtype)``, the copy written by the same kernel where the dtypes differ
    (else x itself)."""
    conv_dtype = conv_dtype or x.dtype
    w = weight.to(conv_dtype).contiguous()
    b = None if bias is None else bias.to(conv_dtype).contiguous()
    write_copy = copy and conv_dtype != x.dtype
    z, xc = torch.ops.linattn_mm.conv_sum(x, w, b, pre, flip, _ROUNDING.get(conv_dtype, 0),
                                          out_dtype or x.dtype, conv_dtype if write_copy else None)
    if copy:
        return z, xc if write_copy else x
    return z


def _token_strides(t):
    """The strides (image, token, channel) of a (B, C, H, W) map's H·W tokens, or None where its
    H and W do not merge into one dim (a size-1 dim's stride does not count)."""
    B, C, H, W = t.shape
    sb, sc, sh, sw = t.stride()
    if W == 1:
        return sb, sh, sc
    if H == 1 or sh == W * sw:
        return sb, sw, sc
    return None


def _mergeable(t):
    """``t``, or a contiguous copy where its H and W do not merge."""
    return t if _token_strides(t) is not None else t.contiguous()


def _scaled_add_grads_outputs(grad, b, b_dtype, need_db, need_df):
    B, C, H, W = grad.shape
    splits, chunk = fused_chunks(H * W, B * -(-C // _ADD_CHANNELS), _ADD_TOKENS, grad.device)
    db = grad.new_empty(0)
    if need_db:  # b's strides where its tokens merge (a mixer's channels-last output), else NCHW
        db = torch.empty_like(b, dtype=b_dtype, memory_format=torch.preserve_format
                              if _token_strides(b) is not None else torch.contiguous_format)
    sums = torch.empty(B, splits, C, dtype=torch.float32, device=grad.device) if need_df else \
        grad.new_empty(0, dtype=torch.float32)
    return (db, sums), chunk


@torch.library.custom_op('linattn_mm::scaled_add_grads', mutates_args=())
def _scaled_add_grads_op(grad: torch.Tensor, b: torch.Tensor, f: torch.Tensor,
                         b_dtype: torch.dtype, need_db: bool,
                         need_df: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``x + b * f`` for (B, C, H, W) maps ``grad`` and ``b`` and ``f``
    (B or 1, C) float32: ``grad * f`` in ``b_dtype`` with b's strides (``need_db``, else an empty
    tensor), and per image and chunk of tokens the sums of ``grad * b`` (B, chunks, C) float32
    (``need_df``)."""
    (db, sums), chunk = _scaled_add_grads_outputs(grad, b, b_dtype, need_db, need_df)
    B, C, H, W = grad.shape
    grad, b = _mergeable(grad), _mergeable(b)
    d_t = _token_strides(db) if need_db else _token_strides(grad)
    launch_fitted(_scaled_add_grads_kernel,
        (-(-C // _ADD_CHANNELS), -(-(H * W) // chunk), B),
        grad, b, f, db if need_db else grad, sums if need_df else f, H * W, C, chunk,
        *_token_strides(grad), *_token_strides(b), *d_t, f.stride(0) if f.shape[0] > 1 else 0,
        f.stride(1), num_warps=fused_warps(), NEED_DB=need_db, NEED_DF=need_df,
        ROUND_OUT=_ROUNDING.get(b_dtype, 0), BT=_ADD_TOKENS, BC=_ADD_CHANNELS)
    return db, sums


@_scaled_add_grads_op.register_fake
def _(grad, b, f, b_dtype, need_db, need_df):
    return _scaled_add_grads_outputs(grad, b, b_dtype, need_db, need_df)[0]


class ScaledAddFused(torch.autograd.Function):
    """:class:`~linattn_mm.ops.lean_layers.ScaledAdd` (``x + b * f``, the residual sum of a
    block's branch with its layer scale and stochastic-depth factor) for (B, C, H, W) maps and
    ``f`` of shape (1 or B, C, 1, 1): the same forward (one ``addcmul``, autocast off) and kept
    tensors; its backward (in float32, float64 inputs too) one Triton kernel that reads the
    gradient and ``b`` once and writes ``b``'s gradient (``grad * f`` in ``b``'s dtype) and the
    partial sums of ``grad * b`` per image and chunk of tokens for ``f``'s (float32), where the
    torch backward makes a float32 product map and sums it (``grad`` in float32 and ``b`` in half
    precision under autocast cannot share a batched product). Inputs: x, b, f, out_dtype."""

    @staticmethod
    def forward(ctx, x, b, f, out_dtype=None):
        return ScaledAdd.forward(ctx, x, b, f, out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_without_autocast
    def backward(ctx, grad):
        b, f = ctx.saved_tensors
        need = ctx.needs_input_grad
        if not (need[1] or need[2]):
            return grad if need[0] else None, None, None, None
        B, C = grad.shape[:2]
        f2 = f.to(torch.float32).reshape(f.shape[0], C)
        db, sums = torch.ops.linattn_mm.scaled_add_grads(
            grad, grad if b is None else b, f2, ctx.b_dtype, need[1], need[2])
        df = None
        if need[2]:
            df = sums.sum(1).view(B, C, 1, 1).sum_to_size(f.shape).to(f.dtype)
        return grad if need[0] else None, db if need[1] else None, df, None


def scaled_add_fused(x, b, f, out_dtype=None):
    """``x + b * f`` through :class:`ScaledAddFused` where ``x`` and ``b`` are (B, C, H, W) maps
    of one shape and ``f`` (1 or B, C, 1, 1); other shapes through
    :func:`~linattn_mm.ops.lean_layers.scaled_add`. The result in ``out_dtype`` (None: the dtype
    the three promote to)."""
    if (x.dim() != 4 or x.shape != b.shape or f.dim() != 4 or f.shape[1] != x.shape[1]
            or f.shape[0] not in (1, x.shape[0]) or f.shape[2:] != (1, 1)):
        return scaled_add(x, b, f, out_dtype)
    return ScaledAddFused.apply(x, b, f, out_dtype)


def _depthwise_weight_grad(grad, inp, weight):
    """cuDNN's weight gradient (in ``grad``'s dtype) of the depth-wise conv ``weight``
    (C, 1, K, K), same padding, of the (B, H, W, C) map ``inp`` with the output gradient ``grad``
    (both views of NCHW maps or channels-last)."""
    k = weight.shape[-1]
    return torch.ops.aten.convolution_backward(
        grad.permute(0, 3, 1, 2), inp.permute(0, 3, 1, 2), weight.to(grad.dtype), None, [1, 1],
        [k // 2, k // 2], [1, 1], False, [0, 0], weight.shape[0], [False, True, False])[1]


def check_fused_conv(owner, conv, x=None):
    """A ``ValueError`` naming ``owner`` unless ``conv`` is a depth-wise conv these kernels run
    (odd square kernel, same padding, stride and dilation 1, one group per channel, zeros
    padding) and ``x`` (if given) a tensor they read: float32, bfloat16 or float16, on CUDA,
    ``meta``, or any device under Triton's interpreter."""
    k = conv.kernel_size
    c = conv.in_channels
    same = conv.padding == 'same' or tuple(conv.padding) == (k[0] // 2,) * 2
    if not (k[0] == k[1] and k[0] % 2 == 1 and same and tuple(conv.stride) == (1, 1)
            and tuple(conv.dilation) == (1, 1) and conv.groups == c == conv.out_channels
            and conv.padding_mode == 'zeros'):
        raise ValueError(f'{owner}: the fused conv sums take a depth-wise conv with an odd square '
                         f"kernel, same zero padding (padding_mode='zeros'), stride 1 and "
                         f'dilation 1; got {conv} (padding_mode={conv.padding_mode!r})')
    if x is None:
        return
    if triton is None or (x.device.type != 'meta' and not triton_available(x.device)):
        raise ValueError(f"{owner}: the fused kernels run on CUDA with Triton installed (or count "
                         f"on meta); the input is on {x.device}: use ffn_core='fast' there")
    if x.dtype not in TRITON_DTYPES:
        raise ValueError(f'{owner}: the fused kernels read float32, bfloat16 or float16; the '
                         f"input is {x.dtype}: use ffn_core='fast' for it")


class ConvFFNBranchFused(torch.autograd.Function):
    """:class:`~linattn_mm.ops.ffn.autograd.ConvFFNBranch` (NaLaFormer's ConvFFN branch on a
    (B, H, W, C) map, exact GELU) with its conv sum ``h + dwconv(h)`` and, backward, the sum's and
    the GELU's gradients as the kernels of the module docstring; the same arguments (but the GELU's
    form), values, gradients and kept tensors."""

    @staticmethod
    def forward(ctx, x, ln_w, ln_b, eps, w1, b1, dw_w, dw_b, w2, b2):
        n, mean, rstd = _layer_norm(x, ln_w, ln_b, eps)
        pre = F.linear(n, w1, b1)  # (B, H, W, rC), in autocast's dtype under autocast
        del n
        z = conv_sum(F.gelu(pre), dw_w, dw_b)
        ctx.eps, ctx.has_b1, ctx.has_b2 = eps, b1 is not None, b2 is not None
        ctx.save_for_backward(x, ln_w, ln_b, mean, rstd, w1, dw_w, dw_b, w2, pre)
        return F.linear(z, w2, b2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_without_autocast
    def backward(ctx, grad):
        x, ln_w, ln_b, mean, rstd, w1, dw_w, dw_b, w2, pre = ctx.saved_tensors
        need = ctx.needs_input_grad
        B, H, W, R = pre.shape
        dt = grad.dtype
        a = F.gelu(pre).to(dt)
        dz, dw2, db2 = _linear_grads(grad.reshape(-1, grad.shape[-1]),
                                     conv_sum(a, dw_w, dw_b).reshape(-1, R), w2, need[8],
                                     need[9] and ctx.has_b2)
        dz = dz.reshape(B, H, W, R)
        ddw = ddb = None
        if need[6]:
            ddw = _depthwise_weight_grad(dz, a, dw_w)
        del a
        if dw_b is not None and need[7]:
            ddb = dz.sum((0, 1, 2))
        dpre = [conv_sum(dz, dw_w, None, pre=pre, flip=True)]
        del dz
        dx, dlw, dlb, dw1, db1 = _conv_ffn_input_grads(ctx, x, ln_w, ln_b, mean, rstd, w1, dpre,
                                                       need)
        return (dx, dlw, dlb, None, dw1, db1, _to(ddw, dw_w), _to(ddb, dw_w), _to(dw2, w2),
                _to(db2, w2))


class ConvResidualFused(torch.autograd.Function):
    """``x + conv(x)`` of an NCHW map ``x`` with a depth-wise conv (``weight`` (C, 1, K, K),
    ``bias`` or None; NaLaFormer's CPE) as the kernels of the module docstring, the conv in the
    dtype autocast runs it in (``conv_dtype``) and the sum in x's (as ``x + cpe(x)`` promotes).
    Keeps what the plain form keeps: x in ``conv_dtype`` when the weight needs a gradient (under
    autocast the half-precision copy, written by the forward kernel); the backward kernel likewise
    writes the result's gradient in ``conv_dtype`` for the weight gradient, which so comes from
    the same inputs as the plain form's. The bias gradient is the sum of that gradient in float32
    (the plain form's under autocast is rounded to the half precision once more: about a unit
    of it apart)."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv_dtype):
        keep = ctx.needs_input_grad[1]  # x for the weight gradient
        out = conv_sum(x.permute(0, 2, 3, 1), weight, bias, conv_dtype=conv_dtype,
                       out_dtype=promote_types(x.dtype, conv_dtype), copy=keep)
        out, xc = out if keep else (out, None)
        ctx.conv_dtype, ctx.x_dtype = conv_dtype, x.dtype
        ctx.save_for_backward(xc, weight, bias)
        return out.permute(0, 3, 1, 2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_without_autocast
    def backward(ctx, grad):
        xc, weight, bias = ctx.saved_tensors
        need = ctx.needs_input_grad
        g = grad.permute(0, 2, 3, 1)
        dx = dw = db = None
        gc = g  # the gradient in conv_dtype, where the weight's needs it
        if need[0]:
            dx = conv_sum(g, weight, None, flip=True, conv_dtype=ctx.conv_dtype,
                          out_dtype=ctx.x_dtype, copy=need[1])
            dx, gc = dx if need[1] else (dx, g)
            dx = dx.permute(0, 3, 1, 2)
        elif need[1]:
            gc = g.to(ctx.conv_dtype)
        if need[1]:
            dw = _depthwise_weight_grad(gc, xc, weight).to(weight.dtype)
        if bias is not None and need[2]:
            db = gc.sum((0, 1, 2), dtype=torch.float32).to(bias.dtype)
        return dx, dw, db, None


def conv_ffn_branch_fused(x, norm, ffn):
    """:class:`ConvFFNBranchFused` on a (B, H, W, C) map with the parameters of a
    ``nn.LayerNorm`` and NaLaFormer's ``ConvFFN``."""
    check_fused_conv('ConvFFN', ffn.dwconv, x)
    if ffn.act.approximate != 'none':
        raise ValueError("ConvFFN: the fused kernels take the exact GELU (approximate='none'), "
                         f"got approximate={ffn.act.approximate!r}")
    return ConvFFNBranchFused.apply(x, norm.weight, norm.bias, norm.eps, ffn.fc1.weight,
                                    ffn.fc1.bias, ffn.dwconv.weight, ffn.dwconv.bias,
                                    ffn.fc2.weight, ffn.fc2.bias)


def conv_residual_fused(x, conv):
    """``x + conv(x)`` of an NCHW map through :class:`ConvResidualFused` (``conv`` a depth-wise
    ``nn.Conv2d`` with same padding), the conv in autocast's dtype when autocast is on."""
    check_fused_conv('CPE', conv, x)
    return ConvResidualFused.apply(x, conv.weight, conv.bias,
                                   autocast_dtype(x.device) or x.dtype)
