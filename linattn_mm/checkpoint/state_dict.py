"""Unwrapping a loaded checkpoint into its state dict, and removing wrapper prefixes."""
import collections
import warnings
from typing import Dict, Mapping, Optional, Tuple

import torch

from .errors import CheckpointError
from .report import format_keys

__all__ = ['extract_state_dict', 'unwrap_checkpoint', 'strip_prefixes', 'EMA_KEYS', 'WRAPPER_KEYS']

#: top-level keys holding EMA weights (preferred when ``prefer_ema``). mmengine's
#: ``ema_state_dict`` is deliberately absent: after EMAHook's swap it holds the *non*-EMA weights.
EMA_KEYS = ('model_ema', 'state_dict_ema')
#: top-level keys wrapping a state dict, in order of preference
WRAPPER_KEYS = ('state_dict', 'model', 'module')


def _has_tensors(d) -> bool:
    return isinstance(d, Mapping) and any(isinstance(v, torch.Tensor) for v in d.values())


def unwrap_checkpoint(ckpt, prefer_ema: bool = True):
    """Return ``(state_dict, source, non_tensor_keys)``; see :func:`extract_state_dict`."""
    if isinstance(ckpt, torch.nn.Module):
        return dict(ckpt.state_dict()), 'module.state_dict()', []
    if not isinstance(ckpt, Mapping):
        raise CheckpointError(
            f'expected a checkpoint dict, got {type(ckpt).__name__}')
    top_keys = list(ckpt.keys())
    current, path = ckpt, []
    # without prefer_ema, EMA weights are still used when they are the only weights in the file
    candidates = (EMA_KEYS + WRAPPER_KEYS) if prefer_ema else (WRAPPER_KEYS + EMA_KEYS)
    for _ in range(4):  # nested wrappers, e.g. {'state_dict': {'model': {...}}}
        chosen = None
        for key in candidates:
            value = current.get(key)
            if isinstance(value, Mapping) and value and _contains_tensor(value):
                chosen = key
                break
        if chosen is None:
            break
        current, path = current[chosen], path + [chosen]
        if _has_tensors(current):
            break
    if not _has_tensors(current):
        raise CheckpointError(
            f'checkpoint contains no tensors in any known layout (top-level keys: '
            f'{format_keys(top_keys, 20)}); expected a state dict, or a dict with one of '
            f'{list(WRAPPER_KEYS) + list(EMA_KEYS)}')
    sd = collections.OrderedDict()
    non_tensor = []
    for k, v in current.items():
        if isinstance(v, torch.Tensor):
            sd[k] = v
        else:
            non_tensor.append(str(k))
    return sd, '.'.join(path) if path else 'raw', non_tensor


def _contains_tensor(d, depth: int = 0) -> bool:
    if not isinstance(d, Mapping) or depth > 4:
        return False
    return any(isinstance(v, torch.Tensor) or _contains_tensor(v, depth + 1) for v in d.values())


def extract_state_dict(ckpt, prefer_ema: bool = True) -> Tuple[Dict[str, torch.Tensor], str]:
    """Unwrap the state dict of a loaded checkpoint.

    Recognised layouts (first match wins): ``model_ema`` / ``state_dict_ema`` (EMA weights, only
    when ``prefer_ema``), ``state_dict`` (mmengine/mmpretrain/mmdet), ``model`` (Swin, PolaFormer,
    DeiT, NaLaFormer...), ``module``; nested wrappers are followed; otherwise the dict itself is the
    state dict when it holds tensors (raw ``{name: tensor}``). With ``prefer_ema=False`` the EMA
    keys are used only when nothing else holds tensors.

    Non-tensor values inside the chosen state dict (e.g. an int ``steps`` counter) are removed and
    listed in a ``UserWarning`` (:func:`load_pretrained` records them in ``LoadReport.non_tensor``
    instead).

    Returns:
        ``(state_dict, source)`` where ``source`` names the key path used, e.g. ``'model_ema'``,
        ``'state_dict'`` or ``'raw'``.

    Raises:
        CheckpointError: no tensors anywhere (message lists the top-level keys seen).
    """
    sd, source, non_tensor = unwrap_checkpoint(ckpt, prefer_ema)
    if non_tensor:
        warnings.warn(f"extract_state_dict: removed {len(non_tensor)} non-tensor entr"
                      f"{'y' if len(non_tensor) == 1 else 'ies'} from '{source}': "
                      f'{format_keys(non_tensor, 20)}', stacklevel=2)
    return sd, source


def strip_prefixes(state_dict: Mapping[str, torch.Tensor], prefix: Optional[str] = None
                   ) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Remove wrapper prefixes from state-dict keys.

    * Leading ``module.`` (DDP / DataParallel, possibly repeated) is always removed.
    * ``prefix`` given (e.g. ``'backbone.'``): only keys starting with it are kept, with it stripped;
      :class:`CheckpointError` (listing some keys) if no key has it. ``prefix=''`` disables all
      prefix filtering.
    * ``prefix=None`` and at least one key starts with ``backbone.``: the file is treated as an
      mmpretrain/mmdet/mmseg model checkpoint: ``backbone.`` keys are kept (stripped), the others
      (head, neck, data_preprocessor...) are dropped.

    Returns:
        ``(new_state_dict, dropped)`` where ``dropped`` maps each removed key to the reason.
    """
    sd = collections.OrderedDict()
    for k, v in state_dict.items():
        while k.startswith('module.'):
            k = k[len('module.'):]
        sd[k] = v
    dropped: Dict[str, str] = {}
    if prefix is None:
        if not any(k.startswith('backbone.') for k in sd):
            return sd, dropped
        prefix = 'backbone.'
        reason = "not part of the backbone (auto-detected 'backbone.' model checkpoint)"
    elif prefix == '':
        return sd, dropped
    else:
        reason = f"outside prefix '{prefix}'"
    kept = collections.OrderedDict()
    for k, v in sd.items():
        if k.startswith(prefix):
            kept[k[len(prefix):]] = v
        else:
            dropped[k] = reason
    if not kept:
        raise CheckpointError(
            f"no checkpoint key starts with prefix '{prefix}' ({len(sd)} keys, e.g. "
            f"{format_keys(list(sd), 8)}); pass the right prefix (or prefix='' for none)")
    return kept, dropped
