"""Triton kernel of PolaFormer's polarity-aware linear attention core (non-causal), for CUDA
inference.

Same maths as :func:`linattn_mm.ops.pola.fast.polarity_attention_fast` (and the reference
:func:`~linattn_mm.ops.pola.reference.polarity_attention_reference`), in two passes over the tokens with the feature maps made in registers:

1. **Keys** (grid: batch·heads × key chunks). Each program reads its chunk of ``k`` (and of the
   position encoding) and ``v`` once, makes ``y = (k + pe) / s`` and the polarity features
   ``k+ = relu(y)^p``, ``k- = relu(-y)^p`` in float32 (one ``exp2(p·log2|y|)`` per element, the sign
   picks the half), and accumulates ``k+ᵀv``, ``k-ᵀv`` (d × d) and the key sums ``Σk+``, ``Σk-`` in
   float32. Partial sums per chunk go to a small buffer that torch adds up; the two per-stream
   matrices ``W+ = [k+ᵀv_s | k-ᵀv_o] / n`` and ``W- = [k-ᵀv_s | k+ᵀv_o] / n`` are then built
   (``q_opp @ X == q_sim @ swap(X)``, see :mod:`linattn_mm.ops.pola.fast`).
2. **Queries** (grid: batch·heads × query blocks). Each program reads a block of ``q``, makes
   ``q+``, ``q-`` the same way, computes the numerators ``q+ W+ + q- W-`` and the two
   denominators (same-signed ``q+·k̄+ + q-·k̄-``, opposite ``q+·k̄- + q-·k̄+``, plus ``eps``) and
   writes the normalised result straight into a ``(B, N, h, d)`` buffer (merging the heads is free).

Inputs may be float32, bfloat16 or float16 (read as they are; every feature, product and sum is
float32; the output has ``out_dtype``). The matmuls use ``input_precision='ieee'`` (no TF32): they
are d × d per token and the kernel is bound by memory traffic, not by them. Head dims are padded
to a power of two ≥ 16 inside the kernel (masked loads), so any ``d`` works.

Forward only: ``core='triton'`` on the mixer, which :func:`linattn_mm.deploy.convert` sets for
CUDA inference. With ``TRITON_INTERPRET=1`` the same kernels run on CPU
tensors through Triton's interpreter, which is how the tests check them on machines without a GPU.
"""
import torch

from ..dispatch import TRITON_DTYPES, triton_available, triton_module

triton = triton_module()  # Triton ships with the CUDA builds of torch; the torch cores never need it
if triton is not None:
    import triton.language as tl

__all__ = ['polarity_attention_triton', 'check_qkv']


if triton is not None:

    @triton.jit
    def _load_tile(ptr, b, head, rows, rd, s_b, s_h, s_n, s_d, mask):
        """Tile ``[rows, rd]`` of batch item ``b``, head ``head`` of a (B, h, L, d) tensor with
        strides ``s_*``, as float32 (zero outside ``mask``)."""
        return tl.load(ptr + b * s_b + head * s_h + rows[:, None] * s_n + rd[None, :] * s_d,
                       mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _features(x, p):
        """(relu(x)^p, relu(-x)^p) of a float32 tile, one exp2/log2 per element (0 -> 0)."""
        a = tl.exp2(p * tl.log2(tl.abs(x)))
        return tl.where(x > 0, a, 0.0), tl.where(x < 0, a, 0.0)

    @triton.jit
    def _pola_keys_kernel(K, V, PE, P, S, KV, KS, n, h, chunk,
                          s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                          s_pb, s_ph, s_pn, s_pd,
                          D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr,
                          HAS_PE: tl.constexpr, HAS_SCALE: tl.constexpr):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // h
        head = bh % h
        rd = tl.arange(0, DP)
        dmask = rd < D
        p = tl.load(P + head * D + rd, mask=dmask, other=1.0)
        if HAS_SCALE:
            inv_s = tl.load(S + head * D + rd, mask=dmask, other=1.0)
        acc_pos = tl.zeros((DP, DP), dtype=tl.float32)
        acc_neg = tl.zeros((DP, DP), dtype=tl.float32)
        sum_pos = tl.zeros((DP, ), dtype=tl.float32)
        sum_neg = tl.zeros((DP, ), dtype=tl.float32)
        start = split * chunk
        for off in range(0, chunk, BLOCK_N):
            rn = start + off + tl.arange(0, BLOCK_N)
            m = (rn < n)[:, None] & dmask[None, :]
            y = _load_tile(K, b, head, rn, rd, s_kb, s_kh, s_kn, s_kd, m)
            if HAS_PE:
                y += _load_tile(PE, b, head, rn, rd, s_pb, s_ph, s_pn, s_pd, m)
            if HAS_SCALE:
                y = y * inv_s[None, :]
            kp, kn = _features(y, p[None, :])
            v = _load_tile(V, b, head, rn, rd, s_vb, s_vh, s_vn, s_vd, m)
            acc_pos += tl.dot(tl.trans(kp), v, input_precision='ieee')
            acc_neg += tl.dot(tl.trans(kn), v, input_precision='ieee')
            sum_pos += tl.sum(kp, axis=0)
            sum_neg += tl.sum(kn, axis=0)
        # partial sums of this chunk: KV (B*h, splits, 2, DP, DP), KS (B*h, splits, 2, DP)
        n_split = tl.num_programs(1)
        kv = KV + (bh * n_split + split) * 2 * DP * DP + rd[:, None] * DP + rd[None, :]
        tl.store(kv, acc_pos)
        tl.store(kv + DP * DP, acc_neg)
        ks = KS + (bh * n_split + split) * 2 * DP + rd
        tl.store(ks, sum_pos)
        tl.store(ks + DP, sum_neg)

    @triton.jit
    def _pola_queries_kernel(Q, W, KS, P, S, O, N, h, eps,
                             s_qb, s_qh, s_qn, s_qd, s_ob, s_on, s_oh, s_od,
                             D: tl.constexpr, D_SAME: tl.constexpr, DP: tl.constexpr,
                             BLOCK_M: tl.constexpr, HAS_SCALE: tl.constexpr):
        bh = tl.program_id(0)
        b = bh // h
        head = bh % h
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rd = tl.arange(0, DP)
        dmask = rd < D
        m = (rm < N)[:, None] & dmask[None, :]
        p = tl.load(P + head * D + rd, mask=dmask, other=1.0)
        y = _load_tile(Q, b, head, rm, rd, s_qb, s_qh, s_qn, s_qd, m)
        if HAS_SCALE:
            y = y * tl.load(S + head * D + rd, mask=dmask, other=1.0)[None, :]
        qp, qn = _features(y, p[None, :])
        w = W + bh * 2 * DP * DP + rd[:, None] * DP + rd[None, :]
        num = tl.dot(qp, tl.load(w), input_precision='ieee')
        num += tl.dot(qn, tl.load(w + DP * DP), input_precision='ieee')
        ks_pos = tl.load(KS + bh * 2 * DP + rd)  # key means (sums / n), zero on the padding
        ks_neg = tl.load(KS + bh * 2 * DP + DP + rd)
        den_same = tl.sum(qp * ks_pos[None, :] + qn * ks_neg[None, :], axis=1) + eps
        den_opp = tl.sum(qp * ks_neg[None, :] + qn * ks_pos[None, :], axis=1) + eps
        den = tl.where((rd < D_SAME)[None, :], den_same[:, None], den_opp[:, None])
        out = num / den
        tl.store(O + b * s_ob + rm[:, None] * s_on + head * s_oh + rd[None, :] * s_od,
                 out.to(O.dtype.element_ty), mask=m)


def _per_head(t, h, d, name):
    """``t`` broadcastable to (1, h, 1, d) -> contiguous float32 (h, d)."""
    try:
        return t.to(torch.float32).expand(1, h, 1, d).reshape(h, d).contiguous()
    except RuntimeError as e:
        raise ValueError(f'polarity_attention_triton: {name} of shape {tuple(t.shape)} does not '
                         f'broadcast to (1, {h}, 1, {d})') from e


def check_qkv(fn, q, k, v):
    """Validate per-head ``q`` (B, h, N, d), ``k``, ``v`` (B, h, n, d) for a Triton core named
    ``fn``: Triton present, shapes, dtypes and device. Returns ``B, h, N, n, d``."""
    if triton is None:
        raise RuntimeError(f'{fn} needs Triton (installed with the CUDA builds of torch)')
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f'{fn}: q, k, v must be (B, h, N, d), got '
                         f'{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}')
    B, h, N, d = q.shape
    n = k.shape[2]
    if k.shape != (B, h, n, d) or v.shape != (B, h, n, d):
        raise ValueError(f'{fn}: k and v must be (B, h, n, d) = (B={B}, h={h}, n, d={d}), got '
                         f'{tuple(k.shape)} and {tuple(v.shape)}')
    for name, t in (('q', q), ('k', k), ('v', v)):
        if t.dtype not in TRITON_DTYPES:
            raise TypeError(f'{fn}: {name} has dtype {t.dtype}; supported: '
                            f'{", ".join(str(x) for x in TRITON_DTYPES)}')
        if not triton_available(t):
            raise RuntimeError(f'{fn}: {name} is on {t.device}; the kernel runs on CUDA tensors '
                               f'(or on CPU with TRITON_INTERPRET=1)')
    return B, h, N, n, d


def _num_splits(n, bh, block_n, device):
    """Key chunks per (batch, head): enough programs to fill the GPU twice over."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if \
        device.type == 'cuda' else 4
    blocks = triton.cdiv(n, block_n)
    return max(1, min(blocks, triton.cdiv(2 * sms, bh)))


def polarity_attention_triton(q, k, v, p, eps=1e-6, temperature=None, k_bias=None,
                              out_dtype=None, block_n=64, block_m=64):
    """Polarity-aware linear attention with the Triton kernels (see the module docstring).

    Args:
        q (Tensor): queries (B, h, N, d), any strides.
        k (Tensor): keys (B, h, n, d).
        v (Tensor): values (B, h, n, d).
        p (Tensor): exponents broadcastable to (1, h, 1, d), all > 0.
        eps (float): added to the (mean-normalised) denominators.
        temperature (Tensor, optional): ``softplus(scale)``, broadcastable to (1, h, 1, d); q and k
            are divided by it.
        k_bias (Tensor, optional): position encoding added to ``k`` first, broadcastable to
            (B, h, n, d).
        out_dtype (torch.dtype, optional): output dtype; default ``v.dtype``.

    Returns:
        Tensor: (B, h, N, d), a view of a (B, N, h, d) buffer.
    """
    B, h, N, n, d = check_qkv('polarity_attention_triton', q, k, v)
    dev = q.device
    DP = max(16, triton.next_power_of_2(d))
    p = _per_head(p, h, d, 'p').to(dev)
    has_scale = temperature is not None
    inv_s = (1 / _per_head(temperature, h, d, 'temperature')).to(dev) if has_scale else p
    if k_bias is not None:
        try:
            pe = k_bias.expand(B, h, n, d)
        except RuntimeError as e:
            raise ValueError(f'polarity_attention_triton: k_bias of shape '
                             f'{tuple(k_bias.shape)} does not broadcast to {(B, h, n, d)}') from e
    else:
        pe = k
    splits = _num_splits(n, B * h, block_n, dev)
    chunk = triton.cdiv(triton.cdiv(n, splits), block_n) * block_n
    splits = triton.cdiv(n, chunk)
    kv = torch.empty(B * h, splits, 2, DP, DP, device=dev, dtype=torch.float32)
    ks = torch.empty(B * h, splits, 2, DP, device=dev, dtype=torch.float32)
    _pola_keys_kernel[(B * h, splits)](
        k, v, pe, p, inv_s, kv, ks, n, h, chunk, *k.stride(), *v.stride(), *pe.stride(),
        D=d, DP=DP, BLOCK_N=block_n, HAS_PE=k_bias is not None, HAS_SCALE=has_scale)
    kv = kv.sum(1).mul_(1.0 / n)  # (B*h, 2, DP, DP): [k+ᵀv, k-ᵀv] / n
    ks = ks.sum(1).mul_(1.0 / n)  # key means
    # columns [0, d_s) take the same-signed stream, the rest the opposite one:
    # W+ = [k+ᵀv | k-ᵀv], W- = [k-ᵀv | k+ᵀv] column-wise
    d_same = (d + 1) // 2
    same = (torch.arange(DP, device=dev) < d_same).view(1, DP)
    w = torch.stack([torch.where(same, kv[:, 0], kv[:, 1]),
                     torch.where(same, kv[:, 1], kv[:, 0])], dim=1).contiguous()
    out = torch.empty(B, N, h, d, device=dev, dtype=out_dtype or v.dtype)
    _pola_queries_kernel[(B * h, triton.cdiv(N, block_m))](
        q, w, ks.contiguous(), p, inv_s, out, N, h, float(eps), *q.stride(), *out.stride(),
        D=d, D_SAME=d_same, DP=DP, BLOCK_M=block_m, HAS_SCALE=has_scale)
    return out.transpose(1, 2)
