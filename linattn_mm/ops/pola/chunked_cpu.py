"""The whole Pola layer in CPU inference, a few thousand tokens at a time.

Used by the inference form that :func:`linattn_mm.deploy.convert` gives
:class:`~linattn_mm.models.attentions.pola.PolaLinearAttention` on CPU: projections, polarity
features, the key and query GEMMs, normalisation, the conv term, the gate and the output projection
run chunk by chunk on buffers that stay in the caches, with the kernels' pieces of
:mod:`linattn_mm.ops.pola.fast`.
"""
import torch

from ..common import chunked_layer_setup, linear_into
from .fast import _normalise_into, _pos_neg_into, _query_weights

__all__ = ['polarity_layer_chunked', 'LAYER_CHUNK_ROWS', 'LAYER_CHUNK_ELEMENTS']


#: tokens per chunk of :func:`polarity_layer_chunked`; None: ``LAYER_CHUNK_ELEMENTS // C`` tokens
#: (at least 256)
LAYER_CHUNK_ROWS = None
#: tokens x channels per chunk (measured on CPU, one thread, fp32, Pola-PVT-T layers at 1024²:
#: best near 2048 tokens at C = 64, 1024 at C = 128, 256-1024 at C = 320 and 512 at C = 512;
#: 4096 tokens at every width was up to 16 % slower)
LAYER_CHUNK_ELEMENTS = 2 ** 17


def polarity_layer_chunked(x, w_q, b_q, w_kv, b_kv, w_g, b_g, w_proj, b_proj, p, inv_scale, pe,
                           eps, num_heads, conv_term, rows=None):
    """The whole Pola layer in inference, ``rows`` tokens of one image at a time (CPU).

    The layer's big intermediates (the (N, 4C) projection, the (N, C) feature halves of q and k,
    the query-side GEMM's (N, d + 2) results, the normalised streams) are never made whole: each
    chunk goes through projection, feature map and GEMM while it is in cache, and the buffers are
    reused from chunk to chunk. Two passes over the tokens of each image:

    1. keys: ``[k | v] = x W_kv^T + b``, the polarity features of ``(k + pe) / s``, and the sums
       ``k+^T v``, ``k-^T v``, ``sum k+``, ``sum k-`` accumulated over the chunks; ``v`` is kept
       for the depth-wise conv term.
    2. queries: ``q``, ``g`` projections, features, ``q+ W+ + q- W-``, normalisation, ``+
       conv_term(v)`` (unless ``conv_term`` is None), ``* g`` and the output projection, written
       into the result.

    Same operations as :func:`~linattn_mm.ops.pola.fast.polarity_attention_fast` up to the order of
    the sums over tokens.

    Args:
        x (Tensor): tokens (B, N, C), float32 / float64, CPU.
        w_q, b_q, w_g, b_g (Tensor): query and gate projections (C, C), (C, ) (biases optional).
        w_kv, b_kv (Tensor): key / value projection (2C, C), keys first.
        w_proj, b_proj (Tensor): output projection (C, C), (C, ).
        p (Tensor): exponents (C, ) (head-major channel order), all >= 1.
        inv_scale (Tensor | None): ``1 / softplus(scale)`` (C, ).
        pe (Tensor | None): position encoding added to k, (N, C).
        eps (float): added to the mean-normalised denominators.
        num_heads (int): heads h; the head dim ``C / h`` must be even.
        conv_term (callable | None): ``v`` (B, N, C) -> the depth-wise conv term (B, N, C);
            None: no conv term (PolaFormer without its DWC, ``use_dwc=False``).
        rows (int, optional): tokens per chunk, default :data:`LAYER_CHUNK_ROWS` or, when that is
            None, :data:`LAYER_CHUNK_ELEMENTS` ``// C``.

    Returns:
        Tensor: (B, N, C).
    """
    B, N, C, d, rows = chunked_layer_setup('polarity_layer_chunked', x, num_heads, rows,
                                           LAYER_CHUNK_ROWS, LAYER_CHUNK_ELEMENTS, True, w_q,
                                           w_kv, w_g, w_proj, p, inv_scale, pe)
    h = num_heads
    new = x.new_empty

    # pass 1: keys and values
    v = new(B, N, C)
    kv_buf, c_buf, a_buf = new(rows, 2 * C), new(rows, C), new(rows, C)
    w_pos, w_neg = new(B, h, d, d + 2), new(B, h, d, d + 2)
    kvp, kvn, ksp, ksn = new(h, d, d), new(h, d, d), new(C), new(C)
    for b in range(B):
        for t in (kvp, kvn, ksp, ksn):
            t.zero_()
        for s in range(0, N, rows):
            m = min(rows, N - s)
            kv = linear_into(x[b, s:s + m], w_kv, b_kv, kv_buf[:m])
            v[b, s:s + m] = kv[:, C:]
            kp, kn = _pos_neg_into(kv[:, :C], p, inv_scale, None if pe is None else pe[s:s + m],
                                   c_buf[:m], a_buf[:m])
            vh = v[b, s:s + m].view(m, h, d).transpose(0, 1)  # (h, m, d)
            torch.baddbmm(kvp, kp.view(m, h, d).permute(1, 2, 0), vh, out=kvp)
            torch.baddbmm(kvn, kn.view(m, h, d).permute(1, 2, 0), vh, out=kvn)
            ksp.add_(kp.sum(0))
            ksn.add_(kn.sum(0))
        _query_weights(kvp, kvn, ksp.view(h, d, 1), ksn.view(h, d, 1), N, w_pos[b], w_neg[b])
    conv = None if conv_term is None else conv_term(v)
    del v
    # pass 2: queries, output
    out = new(B, N, C)
    q_buf, g_buf, r_buf, o_buf = new(rows, C), new(rows, C), new(h, rows, d + 2), new(rows, C)
    for b in range(B):
        for s in range(0, N, rows):
            m = min(rows, N - s)
            xs = x[b, s:s + m]
            qp, qn = _pos_neg_into(linear_into(xs, w_q, b_q, q_buf[:m]), p, inv_scale, None,
                                   c_buf[:m], a_buf[:m])
            r = torch.bmm(qp.view(m, h, d).transpose(0, 1), w_pos[b], out=r_buf[:, :m])
            torch.baddbmm(r, qn.view(m, h, d).transpose(0, 1), w_neg[b], out=r)
            _normalise_into(r, eps, o_buf[:m].view(m, h, d).transpose(0, 1))
            o = o_buf[:m] if conv is None else o_buf[:m].add_(conv[b, s:s + m])
            o.mul_(linear_into(xs, w_g, b_g, g_buf[:m]))
            linear_into(o, w_proj, b_proj, out[b, s:s + m])
    return out
