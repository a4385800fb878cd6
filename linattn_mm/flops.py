"""Multiply-accumulate (MAC) counting that sees every attention matmul.

OpenMMLab papers report "FLOPs" as multiply-accumulates of the convolutions, linear layers and
matrix products (fvcore convention: element-wise work, normalisation and activations count 0).
mmengine's counter hooks modules, so it misses functional matmuls (``q @ k.transpose``, einsum)
and ``F.scaled_dot_product_attention``, i.e. most of what an attention family computes. This
counter runs the model under :class:`torch.utils.flop_counter.FlopCounterMode`, which intercepts
the aten ops themselves (``mm``, ``bmm``, ``addmm``, convolutions, einsum through its bmm), and adds
the CPU fused-attention kernel that torch's table lacks. MACs = FLOPs / 2.
"""
from collections import defaultdict

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ['count_macs', 'MacCount', 'sdpa_macs']

aten = torch.ops.aten


def sdpa_macs(q_shape, k_shape, v_shape):
    """MACs of softmax attention on (B, h, L, E) queries, (B, h, S, E) keys and (B, h, S, Ev)
    values: ``B·h·L·S·(E + Ev)`` (the logits and the weighted sum)."""
    *batch, L, E = q_shape
    S, Ev = k_shape[-2], v_shape[-1]
    b = 1
    for s in batch:
        b *= s
    return b * L * S * (E + Ev)


def _sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    return 2 * sdpa_macs(query_shape, key_shape, value_shape)


def _custom_mapping():
    mapping = {}
    for name in ('_scaled_dot_product_flash_attention_for_cpu',
                 '_scaled_dot_product_fused_attention_overrideable'):
        op = getattr(aten, name, None)
        if op is not None:
            mapping[op] = _sdpa_cpu_flops
    return mapping


class MacCount:
    """Result of :func:`count_macs`: ``total`` MACs, ``by_module`` (module path -> MACs, every
    depth, ``''`` = the whole model) and ``by_op`` (aten op -> MACs)."""

    def __init__(self, total, by_module, by_op):
        self.total = total
        self.by_module = by_module
        self.by_op = by_op

    @property
    def gmacs(self):
        return self.total / 1e9

    def __repr__(self):
        return f'MacCount({self.gmacs:.4f} GMACs)'


def count_macs(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` (a module or any callable) without gradients and count its
    multiply-accumulates (see the module docstring for what is counted).

    Returns:
        MacCount
    """
    counter = FlopCounterMode(display=False, depth=None, custom_mapping=_custom_mapping())
    with torch.no_grad(), counter:
        fn(*args, **kwargs)
    by_module = {}
    for mod, ops in counter.get_flop_counts().items():
        key = '' if mod == 'Global' else mod.split('.', 1)[1] if '.' in mod else ''
        by_module[key] = sum(ops.values()) // 2
    by_op = defaultdict(int)
    for op, n in counter.get_flop_counts().get('Global', {}).items():
        by_op[str(op)] += n // 2
    return MacCount(counter.get_total_flops() // 2, by_module, dict(by_op))
