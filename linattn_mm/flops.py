"""Multiply-accumulate (MAC) counting that sees every attention matmul.

OpenMMLab papers report "FLOPs" as multiply-accumulates of the convolutions, linear layers and
matrix products (fvcore convention: element-wise work, normalisation and activations count 0).
mmengine's counter hooks modules, so it misses functional matmuls (``q @ k.transpose``, einsum)
and ``F.scaled_dot_product_attention``, i.e. most of what an attention family computes. This
counter runs the model under :class:`torch.utils.flop_counter.FlopCounterMode`, which intercepts
the aten ops themselves (``mm``, ``bmm``, ``addmm``, convolutions, einsum through its bmm), and adds
the CPU fused-attention kernel that torch's table lacks. MACs = FLOPs / 2.
"""
import contextlib
import math
from collections import defaultdict

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ['count_macs', 'MacCount', 'sdpa_macs', 'dummy_inputs', 'config_macs', 'DEFAULT_SHAPES']

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


#: the attributes that name a module's kernel (``'fast'`` / ``'reference'`` / ``'triton'``)
CORE_ATTRIBUTES = ('core', 'ffn_core')


@contextlib.contextmanager
def reference_cores(fn):
    """Run ``fn`` (a module) in its plain forms: the attention mixers and FFNs with their reference
    cores (every attribute of :data:`CORE_ATTRIBUTES` set to ``'reference'``) and converted modules
    (:func:`linattn_mm.deploy.convert`) with their plain ``forward``; both are restored
    afterwards. The fast cores and the inference forms reorganise the same model (e.g. NaLa's RoPE
    folded into (4d, d) matrices makes its two small GEMMs twice as wide while removing
    element-wise passes; the fused FFN and the GEMM patch embedding bypass the ``fc1`` / ``proj``
    modules the per-module counts are named after), so the count is that of the model in its
    official form, whatever the kernel."""
    from linattn_mm.deploy import plain_forms
    if not isinstance(fn, torch.nn.Module):
        yield
        return
    with plain_forms(fn):
        cores = [(m, attr, getattr(m, attr)) for m in fn.modules() for attr in CORE_ATTRIBUTES
                 if isinstance(getattr(m, attr, None), str)]
        try:
            for m, attr, _ in cores:
                setattr(m, attr, 'reference')
            yield
        finally:
            for m, attr, core in cores:
                setattr(m, attr, core)


def count_macs(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` (a module or any callable) without gradients and count its
    multiply-accumulates (see the module docstring for what is counted). The attention mixers of a
    module run their reference cores while counted (:func:`reference_cores`).

    Returns:
        MacCount
    """
    counter = FlopCounterMode(display=False, depth=None, custom_mapping=_custom_mapping())
    with torch.no_grad(), reference_cores(fn), counter:
        fn(*args, **kwargs)
    by_module = {}
    for mod, ops in counter.get_flop_counts().items():
        key = '' if mod == 'Global' else mod.split('.', 1)[1] if '.' in mod else ''
        by_module[key] = sum(ops.values()) // 2
    by_op = defaultdict(int)
    for op, n in counter.get_flop_counts().get('Global', {}).items():
        by_op[str(op)] += n // 2
    return MacCount(counter.get_total_flops() // 2, by_module, dict(by_op))


#: input shape (H, W) of each library's usual FLOP figures
DEFAULT_SHAPES = {'mmdet': (800, 1333), 'mmseg': (512, 512), 'mmpretrain': (224, 224)}


def dummy_inputs(cfg, shape):
    """A batch of one random image at ``shape`` (H, W) for the model of ``cfg`` and its data
    samples, as the data preprocessor would produce them: mmdet inputs are padded to the size
    divisor; classifiers get no data samples."""
    H, W = shape
    scope = cfg.get('default_scope', 'mmpretrain')
    if scope == 'mmdet':
        div = cfg.model.get('data_preprocessor', {}).get('pad_size_divisor', 32) or 1
        Hp, Wp = math.ceil(H / div) * div, math.ceil(W / div) * div
        from mmdet.structures import DetDataSample
        sample = DetDataSample(metainfo=dict(img_shape=(H, W), ori_shape=(H, W),
                                             pad_shape=(Hp, Wp), batch_input_shape=(Hp, Wp),
                                             scale_factor=(1.0, 1.0)))
        return torch.randn(1, 3, Hp, Wp), [sample]
    if scope == 'mmseg':
        from mmseg.structures import SegDataSample
        sample = SegDataSample(metainfo=dict(img_shape=(H, W), ori_shape=(H, W),
                                             pad_shape=(H, W), batch_input_shape=(H, W)))
        return torch.randn(1, 3, H, W), [sample]
    return torch.randn(1, 3, H, W), None


def config_macs(config, shape=None, part='model'):
    """Parameters and MACs of the model of a config (file, zoo name or Config) at ``shape``
    (default: :data:`DEFAULT_SHAPES` of its library). ``part='model'`` counts the whole forward in
    ``mode='tensor'`` (backbone, neck and heads, as the stock get_flops tools; a two-stage detector
    includes its RoI heads on the RPN proposals); ``'backbone'`` the backbone only.

    Returns:
        dict: scope, input_shape, part, params, macs, by_module (see :class:`MacCount`).
    """
    from linattn_mm.apis import build_model, get_config
    cfg = get_config(config)
    scope = cfg.get('default_scope', 'mmpretrain')
    model = build_model(cfg, pretrained_backbone=False).eval()  # counting needs no weights
    if shape is None:
        shape = DEFAULT_SHAPES.get(scope, (224, 224))
    if len(shape) not in (1, 2) or any(int(v) != v or v < 1 for v in shape):
        raise ValueError(f'input shape {tuple(shape)}: give one side S or H W (positive '
                         f'integers)')
    shape = tuple(shape) if len(shape) == 2 else (shape[0], shape[0])
    inputs, samples = dummy_inputs(cfg, shape)
    if part == 'backbone':
        counted = model.backbone
        count = count_macs(counted, inputs)
    else:
        counted = model
        count = count_macs(model, inputs, samples, mode='tensor')
    return dict(scope=scope, input_shape=list(inputs.shape), part=part,
                params=sum(p.numel() for p in counted.parameters()), macs=count.total,
                by_module=count.by_module)
