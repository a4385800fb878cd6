"""The 2-D RoPE of NaLa's softmax stages as one Triton kernel each way (CUDA; the
:class:`~linattn_mm.models.attentions.nala.NaLaSoftmaxAttention` mixers' ``core='fused'``).

The released NaLaFormer's stages 3-4 rotate q and k by the RoPE in float32, as the official code
does, and the fused attention kernel then reads them in the autocast dtype. In torch, under bf16
autocast, each of q and k takes a cast to float32, the rotation (complex products of the channel
pairs, :class:`~linattn_mm.ops.nala.fast.RotatePairs`) and autocast's cast back: 20 bytes moved
per element each way, where the data is 2 bytes read and 2 written. Here, per channel pair
``(x0, x1)`` with the pair's angle ``(cos, sin)``:

* **Forward**, one kernel: reads ``x`` in its dtype and strides, computes
  ``y = (x0 cos - x1 sin, x1 cos + x0 sin)`` in float32 and writes it rounded once to the dtype
  the attention runs in (the autocast dtype; float32 without autocast).
* **Backward**, the same kernel with the conjugate angle: reads the gradient in its dtype, writes
  ``(g0 cos + g1 sin, g1 cos - g0 sin)`` in ``x``'s dtype.

Both write a (B, N, h, d) buffer and return its (B, h, N, d) view: the attention takes it as it
is, and merging the heads of the gradient into the projection's copies nothing. The angles come
as one (N, d / 2, 2) float32 table ``[cos, sin]`` per pair: the real view of the complex table of
:func:`~linattn_mm.ops.nala.fast.rope_turn`, which a stage's
:class:`~linattn_mm.ops.nala.fast.RopeTables` makes once for all its layers. Kept for backward:
that table only. The values are those of the torch form up to the rounding of the float32 steps
(torch rounds the rotated pair to float32, then to the autocast dtype; here it is rounded once;
under Triton's interpreter not one bfloat16 element of the tests differs).
:func:`rope_rotate_fused` takes float32, bfloat16 and float16 ``x``; other dtypes and empty maps
go through :func:`~linattn_mm.ops.nala.fast.rotate_pairs` with the cast the torch
form has. CUDA, or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``); on ``meta``
each launch is one operation for the counters of :mod:`linattn_mm.utils`.
"""
import torch

from ..common import backward_without_autocast, promote_types
from ..dispatch import (TRITON_DTYPES, fused_block, fused_warps, launch_fitted, triton_available,
                        triton_module)
from ..ffn.fused import _ROUNDING
from .fast import RopeTables, rope_turn, rotate_pairs

triton = triton_module()
if triton is not None:
    import triton.language as tl

    from ..ffn.fused import _round

__all__ = ['RopeRotateFused', 'rope_rotate_fused', 'rope_table']

if triton is not None:

    @triton.jit
    def _rope_kernel(X, CS, Y, N, h, s_xb, s_xh, s_xn, s_xd,
                     D2: tl.constexpr, DP2: tl.constexpr, BLOCK: tl.constexpr,
                     CONJ: tl.constexpr, ROUND: tl.constexpr):
        bh = tl.program_id(0)
        b, head = bh // h, bh % h
        rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        rj = tl.arange(0, DP2)  # channel pairs
        m = (rn < N)[:, None] & (rj < D2)[None, :]
        x = X + b.to(tl.int64) * s_xb + head * s_xh + rn[:, None].to(tl.int64) * s_xn
        x0 = tl.load(x + (2 * rj)[None, :] * s_xd, mask=m, other=0.0).to(tl.float32)
        x1 = tl.load(x + (2 * rj + 1)[None, :] * s_xd, mask=m, other=0.0).to(tl.float32)
        t = CS + (rn[:, None] * D2 + rj[None, :]) * 2  # the pair's (cos, sin)
        c = tl.load(t, mask=m, other=0.0)
        s = tl.load(t + 1, mask=m, other=0.0)
        if CONJ:
            s = -s
        y0 = _round(x0 * c - x1 * s, ROUND)
        y1 = _round(x1 * c + x0 * s, ROUND)
        y = Y + ((b.to(tl.int64) * N + rn[:, None]) * h + head) * (2 * D2) + 2 * rj[None, :]
        tl.store(y, y0.to(Y.dtype.element_ty), mask=m)
        tl.store(y + 1, y1.to(Y.dtype.element_ty), mask=m)


def _rotated(x, out_dtype):
    B, h, N, d = x.shape
    return torch.empty(B, N, h, d, dtype=out_dtype, device=x.device)


@torch.library.custom_op('linattn_mm::rope_rotate', mutates_args=())
def _rope_op(x: torch.Tensor, table: torch.Tensor, conj: bool,
             out_dtype: torch.dtype) -> torch.Tensor:
    """The channel pairs of ``x`` (B, h, N, d) (any strides) turned by the angles of the
    (N, d / 2, 2) float32 ``[cos, sin]`` table (contiguous; ``conj``: by their conjugates), as a
    (B, N, h, d) tensor in ``out_dtype``."""
    B, h, N, d = x.shape
    y = _rotated(x, out_dtype)
    table = table.contiguous()
    block = fused_block(d)
    launch_fitted(_rope_kernel, (B * h, triton.cdiv(N, block)), x, table, y, N, h,
                  *x.stride(), num_warps=fused_warps(), D2=d // 2,
                  DP2=triton.next_power_of_2(max(d // 2, 1)), BLOCK=block, CONJ=conj,
                  ROUND=_ROUNDING.get(out_dtype, 0))
    return y


@_rope_op.register_fake
def _(x, table, conj, out_dtype):
    return _rotated(x, out_dtype)


def rope_table(sin, cos, shared=None):
    """The (N, d / 2, 2) float32 ``[cos, sin]`` table of the (N, d) RoPE tables ``sin``, ``cos``
    (each pair of channels shares its angle): the real view of :func:`~linattn_mm.ops.nala.fast.
    rope_turn`'s complex table, ``shared``'s (a :class:`~linattn_mm.ops.nala.fast.RopeTables`,
    made once for the stage) where given."""
    sin, cos = sin.to(torch.float32), cos.to(torch.float32)
    if isinstance(shared, RopeTables) and not torch.compiler.is_compiling():
        return torch.view_as_real(shared.turns(sin, cos)[0])
    return torch.view_as_real(rope_turn(sin, cos))  # (compiled: the compiler fuses it)


def _check(x, table):
    if triton is None:
        raise RuntimeError('RopeRotateFused needs Triton (installed with the CUDA builds of torch)')
    if not (triton_available(x) or x.device.type == 'meta'):
        raise RuntimeError(f'RopeRotateFused: x is on {x.device}; the kernel runs on CUDA tensors '
                           f'(or on CPU with TRITON_INTERPRET=1)')
    if x.dtype not in TRITON_DTYPES:
        raise TypeError(f'RopeRotateFused: x must be float32, bfloat16 or float16, got '
                        f'{x.dtype} (rope_rotate_fused takes other dtypes through the torch '
                        f'form)')
    if x.dim() != 4 or x.shape[-1] % 2 or table.shape != (x.shape[2], x.shape[3] // 2, 2):
        raise ValueError(f'RopeRotateFused: x must be (B, h, N, d) with an even d and the table '
                         f'(N, d / 2, 2), got {tuple(x.shape)} and {tuple(table.shape)}')
    if table.dtype != torch.float32:
        raise TypeError(f'RopeRotateFused: the table must be float32, got {table.dtype}')


class RopeRotateFused(torch.autograd.Function):
    """The RoPE rotation of ``x`` (B, h, N, d) by the angles of the (N, d / 2, 2) float32
    ``[cos, sin]`` table (:func:`rope_table`), one kernel each way (module docstring): the
    result in ``out_dtype``, a (B, h, N, d) view of a (B, N, h, d) buffer; ``x``'s gradient in
    its dtype, a view of the same layout. The table gets no gradient."""

    @staticmethod
    def forward(ctx, x, table, out_dtype):
        _check(x, table)
        table = table.contiguous()
        ctx.save_for_backward(table)
        ctx.x_dtype = x.dtype
        return torch.ops.linattn_mm.rope_rotate(x, table, False, out_dtype).transpose(1, 2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_without_autocast
    def backward(ctx, grad):
        (table, ) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        dx = torch.ops.linattn_mm.rope_rotate(grad, table, True, ctx.x_dtype)
        return dx.transpose(1, 2), None, None


def rope_rotate_fused(x, sin, cos, out_dtype, shared=None):
    """``x`` (B, h, N, d) rotated by the RoPE tables ``sin``, ``cos`` (N, d) in float32 and
    returned in ``out_dtype``: through :class:`RopeRotateFused` for float32, bfloat16 and float16
    ``x`` with tokens, else through :func:`~linattn_mm.ops.nala.fast.rotate_pairs` in the wider
    of x's dtype and float32 (``shared``: its :class:`~linattn_mm.ops.nala.fast.RopeTables`),
    then cast."""
    if x.dtype in TRITON_DTYPES and x.numel():
        return RopeRotateFused.apply(x, rope_table(sin, cos, shared), out_dtype)
    work = promote_types(x.dtype, torch.float32)
    return rotate_pairs(x.to(work), sin.to(work), cos.to(work), shared).to(out_dtype)
