"""Registries of linattn_mm and registration into the downstream OpenMMLab libraries.

``ATTENTIONS`` holds every token mixer (softmax references and the linear families). ``MODELS`` is the
package's own model registry (a child of mmengine's root ``MODELS``), where every backbone is
registered under a unique name. :func:`register_downstream` additionally registers the same classes in
the ``MODELS`` registries of mmpretrain, mmdet and mmseg, so configs of those libraries can use plain
``type='LinAttnSwin'`` names. ``HOOKS`` holds the package's runner hooks. Model code only imports
this module, never mmdet/mmseg/mmpretrain.
"""
import importlib
import importlib.util
import warnings

from mmengine.registry import HOOKS as MMENGINE_HOOKS
from mmengine.registry import MODELS as MMENGINE_MODELS
from mmengine.registry import Registry

MODELS = Registry('model', parent=MMENGINE_MODELS, scope='linattn_mm',
                  locations=['linattn_mm.models'])
ATTENTIONS = Registry('linattn attention', scope='linattn_mm',
                      locations=['linattn_mm.models.attentions'])
#: runner hooks of the package (``type='linattn_mm.SafeGlobalsHook'`` in a config)
HOOKS = Registry('hook', parent=MMENGINE_HOOKS, scope='linattn_mm',
                 locations=['linattn_mm.checkpoint.hook', 'linattn_mm.compile_hook'])

#: downstream library -> module holding its model registry
DOWNSTREAM_REGISTRIES = {
    'mmpretrain': 'mmpretrain.registry',
    'mmdet': 'mmdet.registry',
    'mmseg': 'mmseg.registry',
}

_BACKBONES = []


def register_backbone(cls):
    """Class decorator: register a backbone (or a block that downstream configs name, such as the
    ResNet plugin ``PolyNL2d``) in linattn_mm's ``MODELS`` and remember it for the downstream
    registries."""
    MODELS.register_module(module=cls)
    _BACKBONES.append(cls)
    return cls


def register_hook(cls):
    """Class decorator: register a runner hook in linattn_mm's ``HOOKS``
    (``type='linattn_mm.NAME'``) and under its plain name in mmengine's root registry, which
    mmdet / mmseg / mmpretrain configs fall back to; a plain name taken by another package is
    left to it (never ``force=True``)."""
    HOOKS.register_module(module=cls)
    if cls.__name__ not in MMENGINE_HOOKS.module_dict:
        MMENGINE_HOOKS.register_module(module=cls)
    return cls


def registered_backbones():
    return list(_BACKBONES)


def register_downstream(libraries=None):
    """Register every linattn_mm backbone in the ``MODELS`` registry of each installed downstream
    library. Idempotent; never overrides a class of another package (no ``force=True``): a name that
    is taken by a different class raises ``KeyError``.

    Returns the list of library names that were available.
    """
    done = []
    for lib in libraries or DOWNSTREAM_REGISTRIES:
        if importlib.util.find_spec(DOWNSTREAM_REGISTRIES[lib].split('.')[0]) is None:
            continue  # not installed: nothing to register into
        try:
            registry = importlib.import_module(DOWNSTREAM_REGISTRIES[lib]).MODELS
        except (ImportError, AssertionError) as e:
            # missing, or its version check failed: mmdet / mmseg assert the mmcv version
            warnings.warn(f'linattn_mm: {lib} is not importable ({type(e).__name__}: {e}); its '
                          f'registry is skipped')
            continue
        for cls in _BACKBONES:
            existing = registry.module_dict.get(cls.__name__)
            if existing is cls:
                continue
            if existing is not None:
                raise KeyError(f'{cls.__name__} is already registered in the {lib} model registry '
                               f'by {existing.__module__}; linattn_mm does not override it')
            registry.register_module(module=cls)
        done.append(lib)
    return done
