"""Training with the backbone under ``torch.compile``.

The plugin's training forms trace as one graph without a break (``tests/models/test_compile.py``),
so the compiler can fuse the cores' elementwise steps into kernels of its own. mmengine's own
``cfg.compile`` compiles the whole ``train_step``, the optimizer step included, which dynamo
fails to trace on the supported stack (torch 2.13, mmengine 0.10.7: ``AttributeError:
'UserDefinedDictVariable' object has no attribute 'items'`` at the optimizer's ``param_groups``).
:func:`compile_backbone` compiles the backbone's forward alone (its backward follows), leaving
the heads, the losses and the optimizer eager; :class:`CompileBackboneHook` does it when
training starts (``tools/train.py --compile-backbone``)::

    custom_hooks = [dict(type='linattn_mm.SafeGlobalsHook'),
                    dict(type='linattn_mm.CompileBackboneHook')]  # options of torch.compile
"""
import torch
from mmengine.hooks import Hook

from linattn_mm.registry import register_hook

__all__ = ['compile_backbone', 'CompileBackboneHook']


def compile_backbone(model, **options):
    """Compile ``model.backbone``'s forward with ``torch.compile(**options)`` (the model may be
    wrapped for distributed training: its ``module`` is taken). The compiled forward is set on
    the backbone instance, so its parameters, its state dict keys and the checkpoints stay as
    they are; a backbone already compiled is left as it is. Returns the backbone. The compiled
    forward is bound to this backbone: compile a copy of the model (``copy.deepcopy``) on its own,
    not by copying a compiled one."""
    inner = getattr(model, 'module', model)
    backbone = getattr(inner, 'backbone', None)
    if not isinstance(backbone, torch.nn.Module):
        raise ValueError(f'compile_backbone: {type(inner).__name__} has no backbone module to '
                         f'compile')
    if 'forward' not in backbone.__dict__:
        backbone.forward = torch.compile(backbone.forward, **options)
    return backbone


@register_hook
class CompileBackboneHook(Hook):
    """:func:`compile_backbone` of the runner's model before training starts; the arguments are
    those of ``torch.compile`` (``backend``, ``mode``, ``dynamic``, ...). The first iterations
    compile (minutes), each new input size compiles again."""
    priority = 'LOW'

    def __init__(self, **options):
        self.options = options

    def before_train(self, runner) -> None:
        compile_backbone(runner.model, **self.options)
        runner.logger.info(f'The backbone is compiled (torch.compile {self.options or ""}); the '
                           f'first iterations compile.')

