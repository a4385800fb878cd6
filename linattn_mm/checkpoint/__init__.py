"""Safe loading of pretrained checkpoints for linattn_mm models.

Modules, by job:

* :mod:`.allowlist`: the harmless objects official and mmengine checkpoints pickle
  (:data:`SAFE_GLOBALS`), applied for a ``with`` block by :func:`safe_globals`; importing linattn_mm
  leaves torch's allow-list alone (:func:`allow_safe_globals` is the explicit process-wide opt-in);
* :mod:`.loading`: :func:`safe_load` (local files, URLs, OpenMMLab name schemes, mmengine's
  ``CheckpointLoader`` schemes; a checkpoint never runs code by default);
* :mod:`.state_dict`: :func:`extract_state_dict` and :func:`strip_prefixes`;
* :mod:`.report`: :class:`LoadReport`;
* :mod:`.pipeline`: :func:`load_pretrained` and :func:`convert_checkpoint`;
* :mod:`.resize`: the helpers the model families use in their ``resize_checkpoint_tensor``
  methods (each family resizes its own size-dependent tensors, next to its parameters);
* :mod:`.hook`: :class:`SafeGlobalsHook`, the allow-list around an mmengine runner's loading.
"""
from .allowlist import SAFE_GLOBALS, allow_safe_globals, safe_globals
from .errors import CheckpointError, UnsafePickleWarning
from .hook import SafeGlobalsHook
from .loading import UNSAFE_PICKLE_ENV, resolve_model_url, safe_load
from .pipeline import (DEFAULT_HEAD_KEYS, DEFAULT_IGNORE_BUFFER_KEYS, convert_checkpoint,
                       load_pretrained)
from .report import LoadReport
from .resize import resize_grid_tokens, resize_pos_embed, resize_relative_position_table
from .state_dict import extract_state_dict, strip_prefixes

__all__ = [
    'CheckpointError', 'UnsafePickleWarning', 'SAFE_GLOBALS', 'safe_globals', 'allow_safe_globals',
    'safe_load', 'resolve_model_url', 'extract_state_dict', 'strip_prefixes', 'LoadReport',
    'load_pretrained', 'convert_checkpoint', 'resize_grid_tokens', 'resize_pos_embed',
    'resize_relative_position_table', 'SafeGlobalsHook', 'DEFAULT_IGNORE_BUFFER_KEYS',
    'DEFAULT_HEAD_KEYS', 'UNSAFE_PICKLE_ENV',
]
