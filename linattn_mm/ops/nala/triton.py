"""Triton kernel of NaLaFormer's norm-aware linear attention core (official kernel), for CUDA
inference.

Same maths as :func:`linattn_mm.ops.nala.fast.nala_attention_fast` (and the reference
:func:`~linattn_mm.ops.nala.reference.nala_attention_reference`), in two passes over the tokens
with the feature maps made in registers, as the Pola kernel (:mod:`linattn_mm.ops.pola.triton`):

1. **Keys** (grid: batch·heads × key chunks). Each program reads its chunk of ``k`` and ``v`` once,
   makes ``c = k^lam`` with the sign kept (``k·k·k`` for ``lam = 3``) and the sign split
   ``k+ = relu(c)``, ``k- = relu(-c)`` in float32, and accumulates ``k±ᵀv`` and the key sums
   ``Σk±``. With the 2-D RoPE it accumulates ``(k±·cos)ᵀv`` and ``(k±·sin)ᵀv`` instead: the
   rotation of channel pairs is linear, so ``Σ_j R(φ_j) v_jᵀ = Σ(φ·cos)vᵀ + rot_rows(Σ(φ·sin)vᵀ)``
   is finished on the small (d × d) matrices by torch between the passes.
2. **Queries** (grid: batch·heads × query blocks). Each program reads a block of ``q``, makes the
   norm-dependent power ``p = lam·(0.5 + tanh(‖q‖))`` and ``|q/‖q‖|^p = exp2(p·(log2|q| −
   log2‖q‖))`` with the sign split, the denominator ``φ_q · mean(φ_k) + eps`` from the unrotated
   features, and the numerator ``(φ_q·cos) M + (φ_q·sin)(−rot_rows(M))`` (four d × d products),
   and writes the normalised result straight into a ``(B, N, h, d)`` buffer.

Inputs may be float32, bfloat16 or float16 (every feature, product and sum is float32); matmuls use
``input_precision='ieee'``. Head dims are padded to a power of two ≥ 16 inside the kernel (masked
loads). Forward only: ``core='triton'`` on the mixer, which :func:`linattn_mm.deploy.convert`
sets for CUDA inference. ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors.
"""
import torch

from ..pola.triton import _num_splits, check_qkv, triton
from .fast import _rot_rows

__all__ = ['nala_attention_triton']

if triton is not None:
    import triton.language as tl

    from ..pola.triton import _load_tile

    @triton.jit
    def _key_power(y, lam, CUBE: tl.constexpr):
        """``y^lam`` with the sign of ``y`` kept, float32."""
        if CUBE:
            return y * y * y
        a = tl.exp2(lam * tl.log2(tl.abs(y)))  # 0 at y = 0
        return tl.where(y < 0, -a, a)

    @triton.jit
    def _nala_keys_kernel(K, V, SIN, COS, ACC, KS, n, h, chunk, lam,
                          s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd, s_rn, s_rd,
                          D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr,
                          HAS_ROPE: tl.constexpr, CUBE: tl.constexpr):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // h
        head = bh % h
        rd = tl.arange(0, DP)
        dmask = rd < D
        acc_pc = tl.zeros((DP, DP), dtype=tl.float32)  # (k+ [* cos])^T v
        acc_nc = tl.zeros((DP, DP), dtype=tl.float32)  # (k- [* cos])^T v
        acc_ps = tl.zeros((DP, DP), dtype=tl.float32)  # (k+ * sin)^T v (RoPE only)
        acc_ns = tl.zeros((DP, DP), dtype=tl.float32)
        sum_pos = tl.zeros((DP, ), dtype=tl.float32)
        sum_neg = tl.zeros((DP, ), dtype=tl.float32)
        start = split * chunk
        for off in range(0, chunk, BLOCK_N):
            rn = start + off + tl.arange(0, BLOCK_N)
            m = (rn < n)[:, None] & dmask[None, :]
            y = _load_tile(K, b, head, rn, rd, s_kb, s_kh, s_kn, s_kd, m)
            c = _key_power(y, lam, CUBE)
            kp = tl.maximum(c, 0.0)
            kn = kp - c  # relu(-c), exactly
            v = _load_tile(V, b, head, rn, rd, s_vb, s_vh, s_vn, s_vd, m)
            sum_pos += tl.sum(kp, axis=0)
            sum_neg += tl.sum(kn, axis=0)
            if HAS_ROPE:
                r = rn[:, None] * s_rn + rd[None, :] * s_rd
                cs = tl.load(COS + r, mask=m, other=0.0).to(tl.float32)
                sn = tl.load(SIN + r, mask=m, other=0.0).to(tl.float32)
                acc_pc += tl.dot(tl.trans(kp * cs), v, input_precision='ieee')
                acc_nc += tl.dot(tl.trans(kn * cs), v, input_precision='ieee')
                acc_ps += tl.dot(tl.trans(kp * sn), v, input_precision='ieee')
                acc_ns += tl.dot(tl.trans(kn * sn), v, input_precision='ieee')
            else:
                acc_pc += tl.dot(tl.trans(kp), v, input_precision='ieee')
                acc_nc += tl.dot(tl.trans(kn), v, input_precision='ieee')
        # partial sums of this chunk: ACC (B*h, splits, 4, DP, DP), KS (B*h, splits, 2, DP)
        n_split = tl.num_programs(1)
        acc = ACC + (bh * n_split + split) * 4 * DP * DP + rd[:, None] * DP + rd[None, :]
        tl.store(acc, acc_pc)
        tl.store(acc + DP * DP, acc_nc)
        tl.store(acc + 2 * DP * DP, acc_ps)
        tl.store(acc + 3 * DP * DP, acc_ns)
        ks = KS + (bh * n_split + split) * 2 * DP + rd
        tl.store(ks, sum_pos)
        tl.store(ks + DP, sum_neg)

    @triton.jit
    def _nala_queries_kernel(Q, W, KM, SIN, COS, O, N, h, lam, eps,
                             s_qb, s_qh, s_qn, s_qd, s_ob, s_on, s_oh, s_od, s_rn, s_rd,
                             D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                             HAS_ROPE: tl.constexpr):
        bh = tl.program_id(0)
        b = bh // h
        head = bh % h
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rd = tl.arange(0, DP)
        dmask = rd < D
        m = (rm < N)[:, None] & dmask[None, :]
        y = _load_tile(Q, b, head, rm, rd, s_qb, s_qh, s_qn, s_qd, m)
        qn = tl.sqrt(tl.sum(y * y, axis=1))
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * qn) + 1.0)  # qn >= 0; exp overflow -> tanh = 1
        p = lam * (0.5 + tanh)
        lq = tl.log2(tl.maximum(qn, 1e-12))
        a = tl.exp2(p[:, None] * (tl.log2(tl.abs(y)) - lq[:, None]))  # |q / ||q|| |^p; 0 -> 0
        pos = tl.where(y > 0, a, 0.0)
        neg = tl.where(y < 0, a, 0.0)
        km_pos = tl.load(KM + bh * 2 * DP + rd)  # key feature means, zero on the padding
        km_neg = tl.load(KM + bh * 2 * DP + DP + rd)
        den = tl.sum(pos * km_pos[None, :] + neg * km_neg[None, :], axis=1) + eps
        w = W + bh * 4 * DP * DP + rd[:, None] * DP + rd[None, :]
        if HAS_ROPE:
            r = rm[:, None] * s_rn + rd[None, :] * s_rd
            cs = tl.load(COS + r, mask=m, other=0.0).to(tl.float32)
            sn = tl.load(SIN + r, mask=m, other=0.0).to(tl.float32)
            num = tl.dot(pos * cs, tl.load(w), input_precision='ieee')
            num += tl.dot(neg * cs, tl.load(w + DP * DP), input_precision='ieee')
            num += tl.dot(pos * sn, tl.load(w + 2 * DP * DP), input_precision='ieee')
            num += tl.dot(neg * sn, tl.load(w + 3 * DP * DP), input_precision='ieee')
        else:
            num = tl.dot(pos, tl.load(w), input_precision='ieee')
            num += tl.dot(neg, tl.load(w + DP * DP), input_precision='ieee')
        out = num / den[:, None]
        tl.store(O + b * s_ob + rm[:, None] * s_on + head * s_oh + rd[None, :] * s_od,
                 out.to(O.dtype.element_ty), mask=m)


def nala_attention_triton(q, k, v, power=3., eps=1e-6, sin=None, cos=None, out_dtype=None,
                          block_n=64, block_m=64):
    """Norm-aware linear attention core (official kernel) with the Triton kernels (see the module
    docstring); same arguments and result as :func:`linattn_mm.ops.nala.fast.nala_attention_fast`.

    Args:
        q (Tensor): queries (B, h, N, d), any strides.
        k (Tensor): keys (B, h, N, d).
        v (Tensor): values (B, h, N, d).
        power (float): ``lam`` (key power, scale of the query power). Default 3.
        eps (float): added to the denominator.
        sin, cos (Tensor, optional): the 2-D RoPE (N, d), channel pairs sharing one angle (as
            :class:`~linattn_mm.models.attentions.nala.RoPE2d` makes them); None: no RoPE.
        out_dtype (torch.dtype, optional): output dtype; default ``v.dtype``.

    Returns:
        Tensor: (B, h, N, d), a view of a (B, N, h, d) buffer.
    """
    fn = 'nala_attention_triton'
    if power <= 0:
        raise ValueError(f'{fn}: power must be positive, got {power}')
    has_rope = sin is not None or cos is not None
    if has_rope:
        if sin is None or cos is None:
            raise ValueError(f'{fn}: give both sin and cos, or neither')
        N, n, d = q.shape[-2], k.shape[-2], q.shape[-1]
        if n != N or tuple(sin.shape) != (N, d) or tuple(cos.shape) != (N, d):
            raise ValueError(f'{fn}: the RoPE needs keys on the query grid and sin/cos of shape '
                             f'(N, d) = ({N}, {d}); got n={n}, sin {tuple(sin.shape)}, cos '
                             f'{tuple(cos.shape)}')
        if d % 2:
            raise ValueError(f'{fn}: the RoPE rotates channel pairs; head dim {d} is odd')
    B, h, N, n, d = check_qkv(fn, q, k, v)
    dev = q.device
    if has_rope:
        sin, cos = sin.to(dev), cos.to(dev)
        if cos.stride() != sin.stride():
            sin, cos = sin.contiguous(), cos.contiguous()
    else:
        sin = cos = q  # not read
    DP = max(16, triton.next_power_of_2(d))
    splits = _num_splits(n, B * h, block_n, dev)
    chunk = triton.cdiv(triton.cdiv(n, splits), block_n) * block_n
    splits = triton.cdiv(n, chunk)
    acc = torch.empty(B * h, splits, 4, DP, DP, device=dev, dtype=torch.float32)
    ks = torch.empty(B * h, splits, 2, DP, device=dev, dtype=torch.float32)
    lam = float(power)
    rs = cos.stride() if has_rope else (0, 0)
    _nala_keys_kernel[(B * h, splits)](
        k, v, sin, cos, acc, ks, n, h, chunk, lam, *k.stride(), *v.stride(), *rs,
        D=d, DP=DP, BLOCK_N=block_n, HAS_ROPE=has_rope, CUBE=lam == 3.0,
        # four (DP x DP) float32 accumulators with the RoPE: spread them over more threads for
        # NaLaFormer's d = 64 (a register-pressure choice, not yet timed on a GPU)
        num_warps=8 if has_rope and DP >= 64 else 4)
    acc = acc.sum(1).mul_(1.0 / n)  # (B*h, 4, DP, DP)
    km = ks.sum(1).mul_(1.0 / n).contiguous()  # key feature means (B*h, 2, DP)
    if has_rope:
        # M = sum_j R(phi_j) v_j^T / n per sign half; the queries meet [M+, M-, -rot(M+), -rot(M-)]
        # (rows pair up within each half: d is even and the padding rows are zero)
        mat = acc[:, :2] + _rot_rows(acc[:, 2:])
        w = torch.cat([mat, -_rot_rows(mat)], dim=1).contiguous()
    else:
        w = acc
    out = torch.empty(B, N, h, d, device=dev, dtype=out_dtype or v.dtype)
    _nala_queries_kernel[(B * h, triton.cdiv(N, block_m))](
        q, w, km, sin, cos, out, N, h, lam, float(eps), *q.stride(), *out.stride(), *rs,
        D=d, DP=DP, BLOCK_M=block_m, HAS_ROPE=has_rope)
    return out.transpose(1, 2)
