"""linattn_mm: linear-complexity attention backbones for mmdetection, mmsegmentation and
mmpretrain.

Importing the package allow-lists the harmless (non-code) objects found in official and mmengine
checkpoints for ``torch.load(weights_only=True)``, and registers every backbone in linattn_mm's own model registry and, where those
libraries are installed, in the mmpretrain, mmdet and mmseg ``MODELS`` registries.
"""
from .version import __version__
from . import models  # noqa: F401  (registers attentions and backbones)
from .checkpoint import allow_safe_globals
from .registry import ATTENTIONS, MODELS, register_downstream

# torch.load(weights_only=True) is the default since torch 2.6 and mmengine 0.10.7 relies on it:
# allow-list the harmless objects in official and mmengine checkpoints (no code runs on load).
allow_safe_globals()
register_downstream()

from .apis import get_model, list_models  # noqa: E402

__all__ = ['__version__', 'ATTENTIONS', 'MODELS', 'get_model', 'list_models']
