"""linattn_mm: linear-complexity attention backbones for mmdetection, mmsegmentation and
mmpretrain.

Importing the package registers every backbone in linattn_mm's own model registry and, where those
libraries are installed, in the mmpretrain, mmdet and mmseg ``MODELS`` registries, and the runner
hook ``SafeGlobalsHook``. It leaves ``torch.load``'s allow-list alone: checkpoint loading applies
it only while it loads (:func:`linattn_mm.checkpoint.safe_globals`).
"""
from .version import __version__
from . import models  # noqa: F401  (registers attentions and backbones)
from . import checkpoint  # noqa: F401  (registers SafeGlobalsHook)
from . import compile_hook  # noqa: F401  (registers CompileBackboneHook)
from .registry import ATTENTIONS, MODELS, register_downstream

register_downstream()

from .apis import get_model, list_models  # noqa: E402

__all__ = ['__version__', 'ATTENTIONS', 'MODELS', 'get_model', 'list_models']
