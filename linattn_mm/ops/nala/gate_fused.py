"""NaLa's gated output ``linear(layer_norm(s) * silu(g))`` with its LayerNorm and gate as one
Triton kernel each way (CUDA; the NaLa mixers' ``gate_core='fused'``).

Both NaLa mixers end in ``out_proj(LN(out + LePE(v)) * SiLU(g))``, the LayerNorm and the gate in
float32 and ``out_proj`` under autocast (:class:`~linattn_mm.ops.lean_layers.NormGatedLinear`,
which keeps ``s = out + LePE(v)`` and ``g``). In torch, under bf16 autocast, its forward is a
LayerNorm, a cast of ``g``, a SiLU, a product and autocast's cast of that product: some 40 bytes
moved per element of ``s`` besides the GEMM, and its backward, which recomputes the LayerNorm and
rounds its steps to the gradient's dtype, some 70. Here (per token, over its C channels, with
``n̂ = (s - mean) · rstd``, ``n = n̂ · w_ln + b_ln``, ``a = silu(g)``):

* **Forward**, one kernel: reads ``s`` and ``g``, writes ``y = n · a`` rounded to the dtype
  ``out_proj`` runs in (autocast's cast); then ``out_proj(y)``.
* **Backward**: ``u = grad · W_out`` (a GEMM), then one kernel that reads ``s``, ``g`` and ``u``
  and writes ``y`` again (the forward's, for the weight gradient ``grad^T y``, a GEMM),
  ``dg = u · n · silu'(g)`` in g's dtype and, with ``dn = u · a``,
  ``ds = rstd · (dn·w_ln - mean(dn·w_ln) - n̂ · mean(dn·w_ln · n̂))`` in s's dtype, and per
  chunk of tokens the partial sums of ``dn · n̂`` and ``dn`` (the LayerNorm's weight and bias
  gradients).

Both kernels compute in float64, the LayerNorm's statistics included (each kernel computes them
from the row of ``s`` it reads anyway; none are stored), and round each output once (through
float32 where it is half precision). The float32 error of a whole NaLaFormer's training step
against float64 (the small NaLaFormers of ``tests/kernels/test_conv_sums_fused.py``, both
layouts, four initialisations each) stayed within that test's bound (1.5× the default forms'
error, or 1e-5) in all eight runs: 0.7-1.9× the default forms' error (the torch gate: 0.8-1.7×);
with the kernels' steps in float32 the test's own initialisation broke it (1.58×). These figures
are the float32 noise of a bias gradient summed over many tokens; the Function alone is within
4e-7 of float64. The kernels stay memory-bound on GPUs with full-rate float64 (A100, H100,
H200); on GPUs whose float64 runs at 1/32 to 1/64 of float32 their arithmetic may take about as
long as their bytes.

Kept for backward: ``s``, ``g`` and the weights (:class:`~linattn_mm.ops.lean_layers.
NormGatedLinear` keeps the statistics too). The plain torch form rounds its backward's steps to
the gradient's dtype under autocast, here each result is rounded once. :class:`NormGatedLinearFused`
takes ``s`` in float32 and ``g`` in float32, bfloat16 or float16 and names any other dtype;
:func:`norm_gated_linear_fused` sends other dtypes, a LayerNorm without weight or bias and empty
maps to the torch form. CUDA, or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``); on
``meta`` each launch is one operation for the counters of :mod:`linattn_mm.utils`.
"""
import os
from typing import Tuple

import torch
import torch.nn.functional as F

from ..common import autocast_dtype, backward_without_autocast, token_gram
from ..common import in_dtype_of as _to
from ..dispatch import TRITON_DTYPES, fused_chunks, fused_warps, launch_fitted, triton_module
from ..ffn.fused import _ROUNDING
from ..lean_layers import NormGatedLinear

triton = triton_module()
if triton is not None:
    import triton.language as tl

    from ..ffn.fused import _round

__all__ = ['NormGatedLinearFused', 'norm_gated_linear_fused']

#: elements of a program's tile (tokens × padded channels; float64 in the kernels); under
#: Triton's interpreter, at most
_TILE = 1024
_INTERPRETED_TILE = 1 << 15

if triton is not None:

    @triton.jit
    def _normalised(S, rows, rc, m, C, s_s, eps):
        """``n̂`` of a tile of rows of ``S`` and their rstd, in float64 (the forward and the
        backward compute the same statistics: neither is stored)."""
        s = tl.load(S + rows[:, None].to(tl.int64) * s_s + rc[None, :], mask=m,
                    other=0.0).to(tl.float64)
        mean = tl.sum(s, axis=1) / C
        xc = tl.where(m, s - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / C + eps)
        return xc * rstd[:, None], rstd

    @triton.jit
    def _norm_gate_kernel(S, G, LW, LB, Y, T, C, s_s, s_g, eps,
                          ROUND_OUT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rc = tl.arange(0, BC)
        cm = rc < C
        m = (rows < T)[:, None] & cm[None, :]
        nh = _normalised(S, rows, rc, m, C, s_s, eps)[0]
        w = tl.load(LW + rc, mask=cm, other=0.0).to(tl.float64)
        b = tl.load(LB + rc, mask=cm, other=0.0).to(tl.float64)
        g = tl.load(G + rows[:, None].to(tl.int64) * s_g + rc[None, :], mask=m,
                    other=0.0).to(tl.float64)
        # the backward's y: the same operations in the same order
        y = ((nh * w[None, :] + b[None, :]) * (g * (1.0 / (1.0 + tl.exp(-g))))).to(tl.float32)
        tl.store(Y + rows[:, None].to(tl.int64) * C + rc[None, :],
                 _round(y, ROUND_OUT).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _norm_gate_grads_kernel(S, G, U, LW, LB, Y, DG, DS, PW, PB, T, C, chunk, s_s, s_g, eps,
                                NEED_Y: tl.constexpr, NEED_DG: tl.constexpr,
                                NEED_DS: tl.constexpr, NEED_LN: tl.constexpr,
                                ROUND_Y: tl.constexpr, ROUND_DG: tl.constexpr,
                                ROUND_DS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        split = tl.program_id(0)
        rc = tl.arange(0, BC)
        cm = rc < C
        w = tl.load(LW + rc, mask=cm, other=0.0).to(tl.float64)
        b = tl.load(LB + rc, mask=cm, other=0.0).to(tl.float64)
        acc_w = tl.zeros((BC, ), dtype=tl.float64)
        acc_b = tl.zeros((BC, ), dtype=tl.float64)
        for off in range(0, chunk, BR):
            rows = split * chunk + off + tl.arange(0, BR)
            m = (rows < T)[:, None] & cm[None, :]
            nh, rstd = _normalised(S, rows, rc, m, C, s_s, eps)
            n = nh * w[None, :] + b[None, :]
            g = tl.load(G + rows[:, None].to(tl.int64) * s_g + rc[None, :], mask=m,
                        other=0.0).to(tl.float64)
            sg = 1.0 / (1.0 + tl.exp(-g))
            a = g * sg
            at = rows[:, None].to(tl.int64) * C + rc[None, :]
            u = tl.load(U + at, mask=m, other=0.0).to(tl.float64)
            if NEED_Y:
                y = (n * a).to(tl.float32)
                tl.store(Y + at, _round(y, ROUND_Y).to(Y.dtype.element_ty), mask=m)
            if NEED_DG:
                dg = (u * n * (sg * (1.0 + g * (1.0 - sg)))).to(tl.float32)
                tl.store(DG + at, _round(dg, ROUND_DG).to(DG.dtype.element_ty), mask=m)
            dn = tl.where(m, u * a, 0.0)
            if NEED_DS:
                dnw = dn * w[None, :]
                c1 = tl.sum(dnw, axis=1) / C
                c2 = tl.sum(dnw * nh, axis=1) / C
                ds = (rstd[:, None] * (dnw - c1[:, None] - nh * c2[:, None])).to(tl.float32)
                tl.store(DS + at, _round(ds, ROUND_DS).to(DS.dtype.element_ty), mask=m)
            if NEED_LN:
                acc_w += tl.sum(dn * nh, axis=0)
                acc_b += tl.sum(dn, axis=0)
        if NEED_LN:
            tl.store(PW + split * C + rc, acc_w.to(tl.float32), mask=cm)
            tl.store(PB + split * C + rc, acc_b.to(tl.float32), mask=cm)


def _rows(C):
    """(tokens, padded channels) of a program's tile."""
    bc = max(16, triton.next_power_of_2(C))
    tile = _INTERPRETED_TILE if os.environ.get('TRITON_INTERPRET') == '1' else _TILE
    return max(1, tile // bc), bc


@torch.library.custom_op('linattn_mm::norm_gate', mutates_args=())
def _norm_gate_op(s: torch.Tensor, g: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor,
                  eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``layer_norm(s) * silu(g)`` of (T, C) maps whose channels are contiguous, in
    ``out_dtype`` (rounded once)."""
    y = torch.empty(s.shape, dtype=out_dtype, device=s.device)
    T, C = s.shape
    br, bc = _rows(C)
    launch_fitted(_norm_gate_kernel, (triton.cdiv(T, br), ), s, g, ln_w, ln_b, y, T, C,
                  s.stride(0), g.stride(0), eps, num_warps=fused_warps(),
                  ROUND_OUT=_ROUNDING.get(out_dtype, 0), BR=br, BC=bc)
    return y


@_norm_gate_op.register_fake
def _(s, g, ln_w, ln_b, eps, out_dtype):
    return torch.empty(s.shape, dtype=out_dtype, device=s.device)


def _grads_outputs(s, g, y_dtype, needs):
    T, C = s.shape
    splits, chunk = fused_chunks(T, 1, _rows(C)[0], s.device)
    shapes = ((T, C), (T, C), (T, C), (splits, C), (splits, C))
    dtypes = (y_dtype, g.dtype, s.dtype, torch.float32, torch.float32)
    # what is not asked for: an empty tensor of its own (the outputs may not alias)
    return tuple(torch.empty(shape if need else (0, ), dtype=dtype, device=s.device)
                 for shape, dtype, need in zip(shapes, dtypes, needs + needs[3:])), chunk


@torch.library.custom_op('linattn_mm::norm_gate_grads', mutates_args=())
def _norm_gate_grads_op(s: torch.Tensor, g: torch.Tensor, u: torch.Tensor, ln_w: torch.Tensor,
                        ln_b: torch.Tensor, eps: float, y_dtype: torch.dtype, need_y: bool,
                        need_dg: bool, need_ds: bool,
                        need_ln: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor, torch.Tensor]:
    """From the gradient ``u`` (T, C) of ``layer_norm(s) * silu(g)`` (contiguous): that product
    again in ``y_dtype`` (``need_y``), g's and s's gradients in their dtypes (``need_dg``,
    ``need_ds``) and the partial sums (chunks, C) float32 of the LayerNorm weight's and bias's
    gradients (``need_ln``); empty tensors for what is not asked for."""
    needs = (need_y, need_dg, need_ds, need_ln)
    (y, dg, ds, pw, pb), chunk = _grads_outputs(s, g, y_dtype, needs)
    T, C = s.shape
    br, bc = _rows(C)
    launch_fitted(_norm_gate_grads_kernel, (triton.cdiv(T, chunk), ), s, g, u, ln_w, ln_b,
                  y if need_y else u, dg if need_dg else u, ds if need_ds else u,
                  pw if need_ln else ln_w, pb if need_ln else ln_w, T, C, chunk, s.stride(0),
                  g.stride(0), eps, num_warps=fused_warps(), NEED_Y=need_y, NEED_DG=need_dg,
                  NEED_DS=need_ds, NEED_LN=need_ln, ROUND_Y=_ROUNDING.get(y_dtype, 0),
                  ROUND_DG=_ROUNDING.get(g.dtype, 0), ROUND_DS=_ROUNDING.get(s.dtype, 0), BR=br,
                  BC=bc)
    return y, dg, ds, pw, pb


@_norm_gate_grads_op.register_fake
def _(s, g, u, ln_w, ln_b, eps, y_dtype, need_y, need_dg, need_ds, need_ln):
    return _grads_outputs(s, g, y_dtype, (need_y, need_dg, need_ds, need_ln))[0]


def _kernels_take(s, g):
    """Whether the kernels take ``s`` and ``g`` by their dtypes: ``s`` float32, ``g`` float32,
    bfloat16 or float16."""
    return s.dtype == torch.float32 and g.dtype in TRITON_DTYPES


def _rows_view(t):
    """``t`` (..., C) as (T, C) rows with contiguous channels (a copy only where needed)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class NormGatedLinearFused(torch.autograd.Function):
    """:class:`~linattn_mm.ops.lean_layers.NormGatedLinear` with its LayerNorm and gate as one
    Triton kernel each way (module docstring). Inputs: s, ln_w, ln_b, eps, g, weight, bias."""

    @staticmethod
    def forward(ctx, s, ln_w, ln_b, eps, g, weight, bias):
        if not _kernels_take(s, g):
            raise ValueError(f'NormGatedLinearFused: s must be float32 and g float32, bfloat16 '
                             f'or float16, got {s.dtype} and {g.dtype} (norm_gated_linear_fused '
                             f'takes other dtypes through the torch form)')
        y_dtype = autocast_dtype(s.device) or weight.dtype
        s2, g2 = _rows_view(s), _rows_view(g)
        lw, lb = ln_w.contiguous(), ln_b.contiguous()
        y = torch.ops.linattn_mm.norm_gate(s2, g2, lw, lb, float(eps), y_dtype)
        ctx.save_for_backward(s2, lw, lb, g2, weight)
        ctx.shapes, ctx.has_bias, ctx.eps = (s.shape, g.shape), bias is not None, float(eps)
        return F.linear(y.view(*s.shape[:-1], s.shape[-1]), weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_without_autocast
    def backward(ctx, grad):
        s2, lw, lb, g2, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        dt = grad.dtype
        grad2 = grad.reshape(-1, grad.shape[-1])
        u = (grad2 @ weight.to(dt)).contiguous()
        need_w = need[5]
        y, dg, ds, pw, pb = torch.ops.linattn_mm.norm_gate_grads(
            s2, g2, u, lw, lb, ctx.eps, dt, need_w, need[4], need[0], need[1] or need[2])
        del u
        dw = token_gram(grad2, y) if need_w else None
        db = grad2.sum(0) if ctx.has_bias and need[6] else None
        s_shape, g_shape = ctx.shapes
        return (ds.view(s_shape) if need[0] else None,
                pw.sum(0).to(lw.dtype) if need[1] else None,
                pb.sum(0).to(lb.dtype) if need[2] else None, None,
                dg.view(g_shape) if need[4] else None, _to(dw, weight), _to(db, weight))


def norm_gated_linear_fused(s, ln_w, ln_b, eps, g, weight, bias):
    """``linear(layer_norm(s) * silu(g), weight, bias)`` through :class:`NormGatedLinearFused`
    where the kernels take it (``s`` float32, ``g`` float32 / bfloat16 / float16, a LayerNorm
    with weight and bias, a map with tokens), else through
    :class:`~linattn_mm.ops.lean_layers.NormGatedLinear`."""
    if not _kernels_take(s, g) or ln_w is None or ln_b is None or s.numel() == 0:
        return NormGatedLinear.apply(s, ln_w, ln_b, eps, g, weight, bias)
    return NormGatedLinearFused.apply(s, ln_w, ln_b, eps, g, weight, bias)
