"""Inference forms as an explicit conversion (cf. mmpretrain's ``switch_to_deploy``, timm's
``reparameterize_model``, mmdet's ``fuse_conv_bn``).

The model files hold the parameters and the reference / training forward. :func:`convert` gives the
blocks and mixers of a model their inference forms for a device, in place:

========================================  ==================================================
module                                    CPU form                    | CUDA form
========================================  ==================================================
``PolaLinearAttention``                   whole layer, chunk by chunk | Triton core (d ≤ 32)
``NormAwareLinearAttention`` (official)   whole layer, chunk by chunk | Triton core (d ≤ 32)
``WindowSoftmaxAttention``                windows a group at a time   |
``TransformerBlock`` (no PVTv2 FFN)       FFN half fused, in place    |
``PatchEmbed`` (non-overlapping)          one GEMM on the patches     |
NaLaFormer's blocks, stem, merging     in place, banded ConvFFN    |
========================================  ==================================================

A converted module keeps its class's parameters, buffers and state-dict keys (its class is
swapped for a subclass that overrides ``forward``), so checkpoints load and save as before, and
:func:`revert` undoes the conversion. Its outputs equal the unconverted model's up to float
rounding. It runs inference only (eval mode, no gradient, no autocast on CPU) and says so when
called otherwise. ``tools/test.py``, :func:`linattn_mm.get_model` and ``tools/benchmark.py``
convert by default (``--no-convert`` / ``convert=False`` to opt out); the FLOP counter and the
reference benchmark runs use unconverted models.
"""
import contextlib
import warnings

import torch

from .blocks import (ConvPatchMergingCPU, ConvStemCPU, NaLaBlockCPU, PatchEmbedCPU,
                     TransformerBlockCPU)
from .common import InferenceForm
from .mixers import (NormAwareLinearAttentionCPU, NormAwareLinearAttentionTriton,
                     PolaLinearAttentionCPU, PolaLinearAttentionTriton, WindowSoftmaxAttentionCPU)

__all__ = ['convert', 'revert', 'converted_modules', 'plain_forms', 'FORMS', 'InferenceForm']

#: device type -> the inference forms, each converting instances of exactly its ``base_class``
FORMS = {
    'cpu': (PolaLinearAttentionCPU, NormAwareLinearAttentionCPU, WindowSoftmaxAttentionCPU,
            TransformerBlockCPU, PatchEmbedCPU, ConvStemCPU, ConvPatchMergingCPU, NaLaBlockCPU),
    'cuda': (PolaLinearAttentionTriton, NormAwareLinearAttentionTriton),
}


def _model_device(model):
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device('cpu')


def _has_hooks(module):
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def convert(model, device=None):
    """Give the blocks and mixers of ``model`` their inference forms for ``device`` (default: the
    device of the model's parameters), in place; returns ``model``.

    Modules without an inference form on that device, or that cannot take it (e.g. a Pola mixer with
    class tokens), keep their plain forward; so do modules with forward hooks (the inference forms
    may skip hooks of the layers inside them and update tensors in place). On CUDA the Pola and NaLa
    mixers with head dims up to 32 run their Triton cores when Triton is installed (larger heads
    keep the torch core, faster there: ``max_head_dims`` of the Triton forms); otherwise nothing
    changes there.
    Converting twice is harmless.
    """
    from linattn_mm.ops.dispatch import triton_available
    device = torch.device(device) if device is not None else _model_device(model)
    forms = FORMS.get(device.type, ())
    if device.type == 'cuda' and not triton_available(device):
        forms = ()
    by_class = {form.base_class: form for form in forms}
    skipped = []
    for name, m in model.named_modules():
        form = by_class.get(type(m))
        if form is None or form.unsupported(m) is not None:
            continue
        if _has_hooks(m):
            skipped.append(name or type(m).__name__)
            continue
        if getattr(form, 'device_type', 'cpu') == 'cuda':
            m.__dict__['_core_before_convert'] = m.core
            m.core = 'triton'
        m.__class__ = form
    if skipped:
        warnings.warn(f'linattn_mm.deploy.convert: {len(skipped)} module(s) with forward hooks '
                      f'keep their plain forward: {", ".join(skipped[:10])}', stacklevel=2)
    return model


def revert(model):
    """Undo :func:`convert`: every converted module gets its class back (and its core); returns
    ``model``."""
    for m in model.modules():
        if isinstance(m, InferenceForm):
            m.__class__ = m.base_class
            m.__dict__.pop('_inference_cache', None)
            if '_core_before_convert' in m.__dict__:
                m.core = m.__dict__.pop('_core_before_convert')
    return model


def converted_modules(model):
    """``{name: form class name}`` of the converted modules of ``model``."""
    return {name: type(m).__name__ for name, m in model.named_modules()
            if isinstance(m, InferenceForm)}


@contextlib.contextmanager
def plain_forms(model):
    """Within the context the converted modules of ``model`` run their plain ``forward`` (hooks,
    gradients and any dtype work again); their inference forms come back afterwards."""
    forms = [(m, type(m)) for m in model.modules() if isinstance(m, InferenceForm)]
    try:
        for m, _ in forms:
            m.__class__ = m.base_class
        yield model
    finally:
        for m, form in forms:
            m.__class__ = form
