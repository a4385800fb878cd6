"""Safe loading of pretrained checkpoints for linattn_mm backbones.

Why this module exists
----------------------
Since torch 2.6 ``torch.load`` defaults to ``weights_only=True``: only tensors, containers and an
allow-list of classes may be unpickled. Official checkpoints of the architectures this package ports
pickle a few harmless extra objects next to the weights (an ``argparse.Namespace`` under ``'args'`` in
DeiT/PVT files, a yacs ``CfgNode`` under ``'config'`` in Swin/PolaFormer files, numpy scalars/arrays,
mmengine's ``HistoryBuffer`` in runner checkpoints), so they no longer load, and mmengine 0.10.7 calls
``torch.load`` without ``weights_only``.

Policy implemented here:

* plain tensors load as they are;
* known harmless objects are allow-listed (:data:`SAFE_GLOBALS`, registered by
  :func:`allow_safe_globals`);
* anything else (arbitrary pickled code) is refused with a :class:`CheckpointError` naming the
  offending globals, and loaded only on explicit opt-in (``allow_unsafe_pickle=True`` or the
  environment variable ``LINATTN_ALLOW_UNSAFE_PICKLE=1``), for files you trust;
* a checkpoint never runs code by default.

Pipeline of :func:`load_pretrained`::

    safe_load -> extract_state_dict -> strip_prefixes -> model.convert_pretrained_state_dict (hook)
      -> drop ignored keys -> resize mismatched shapes (resizer registry) -> load_state_dict
      -> LoadReport (logged; strict mode raises)

Hooks a backbone may define
---------------------------
``convert_pretrained_state_dict(self, state_dict) -> dict``
    Called with the unwrapped, prefix-stripped state dict; returns a new dict (typically renaming
    keys of an official checkpoint to this implementation's names).
``pretrained_ignore_keys`` (iterable of regex strings, class or instance attribute)
    Checkpoint keys matching any of them (``re.search``) are dropped and reported; model keys matching
    them are not reported as missing (the model initialises them itself).

Adding a resizer
----------------
::

    @register_resizer(r'my_table$')
    def resize_my_table(key, src, dst_shape):
        return new_tensor  # of shape dst_shape, or (new_tensor, 'note for the report')

Resizers registered later are tried before earlier ones (so they can override the built-ins).
"""
import argparse
import collections
import errno
import logging
import math
import os
import pickle
import re
import types
import warnings
import zipfile
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union
from urllib.parse import urlparse

import torch
import torch.nn.functional as F

__all__ = [
    'CheckpointError', 'UnsafePickleWarning', 'SAFE_GLOBALS', 'allow_safe_globals', 'safe_load',
    'extract_state_dict', 'strip_prefixes', 'register_resizer', 'registered_resizers',
    'resize_tensor', 'LoadReport', 'load_pretrained', 'convert_checkpoint',
    'DEFAULT_IGNORE_BUFFER_KEYS', 'DEFAULT_HEAD_KEYS', 'UNSAFE_PICKLE_ENV',
]

#: environment variable that opts in to unrestricted unpickling (only for files you trust)
UNSAFE_PICKLE_ENV = 'LINATTN_ALLOW_UNSAFE_PICKLE'

#: checkpoint keys of buffers every model recomputes at construction; always dropped from
#: checkpoints and never reported as missing
DEFAULT_IGNORE_BUFFER_KEYS = (r'relative_position_index$', r'attn_mask$',
                              r'relative_coords_table$')

#: classifier heads of the source model; dropped unless the model has the same key with the same
#: shape
DEFAULT_HEAD_KEYS = (r'^head\.', r'^fc\.')

#: top-level keys holding EMA weights (preferred when ``prefer_ema``). mmengine's
#: ``ema_state_dict`` is deliberately absent: after EMAHook's swap it holds the *non*-EMA weights.
_EMA_KEYS = ('model_ema', 'state_dict_ema')
#: top-level keys wrapping a state dict, in order of preference
_WRAPPER_KEYS = ('state_dict', 'model', 'module')


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded as requested (unsafe content, corrupt file, layout or shape
    mismatch). The message always names the file/key concerned and what to do."""


class UnsafePickleWarning(UserWarning):
    """Emitted when a checkpoint is loaded with unrestricted unpickling (explicit opt-in)."""


# ----------------------------------------------------------------------------------------------
# allow-list
# ----------------------------------------------------------------------------------------------
def _build_safe_globals() -> List[Tuple[object, str]]:
    """Build the allow-list as ``(object, 'module.qualname')`` pairs (torch's tuple form, so one
    object can be registered under the several names different library versions pickle)."""
    entries: List[Tuple[object, str]] = [
        (argparse.Namespace, 'argparse.Namespace'),
        (collections.OrderedDict, 'collections.OrderedDict'),
        # yacs CfgNode (Swin / PolaFormer 'config'). A CfgNode is a dict subclass, and torch's
        # weights-only unpickler only fills *exact* dict/OrderedDict/Counter objects (SETITEMS), so
        # neither the real class nor a dict-subclass stand-in can be allow-listed. The name is
        # therefore mapped onto OrderedDict (already allowed by torch, no new code path): the config
        # loads as a nested, inert OrderedDict with CfgNode's flags in its __dict__. yacs need not be
        # installed.
        (collections.OrderedDict, 'yacs.config.CfgNode'),
    ]
    try:
        import pathlib
        for cls in (pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath):
            entries.append((cls, f'pathlib.{cls.__name__}'))  # paths in pickled 'args'
    except ImportError:  # pragma: no cover
        pass
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        np = None
    if np is not None:
        try:  # numpy >= 2
            from numpy._core import multiarray as _ma
        except ImportError:  # pragma: no cover - numpy 1.x
            from numpy.core import multiarray as _ma
        for mod in ('numpy.core.multiarray', 'numpy._core.multiarray'):  # files from numpy 1 / 2
            entries.append((_ma._reconstruct, f'{mod}._reconstruct'))
            entries.append((_ma.scalar, f'{mod}.scalar'))
        entries.append((np.ndarray, 'numpy.ndarray'))
        entries.append((np.dtype, 'numpy.dtype'))
        dtypes = getattr(np, 'dtypes', None)  # numpy >= 1.25: concrete dtype classes
        if dtypes is not None:
            for name in sorted(dir(dtypes)):
                cls = getattr(dtypes, name)
                # object arrays are left out on purpose (they are the one numpy path to pickles
                # of arbitrary objects)
                if (name.endswith('DType') and isinstance(cls, type)
                        and name != 'ObjectDType'):
                    entries.append((cls, f'numpy.dtypes.{name}'))
    try:
        from mmengine.logging.history_buffer import HistoryBuffer
        entries.append((HistoryBuffer, 'mmengine.logging.history_buffer.HistoryBuffer'))
        # HistoryBuffer.__getstate__ pickles its statistics methods by reference, i.e. as
        # ``getattr(HistoryBuffer, 'min')``. The real ``getattr`` stays forbidden; this name maps
        # to a restricted version that can only fetch plain functions defined on those classes.
        _GETATTR_OWNERS.add(HistoryBuffer)
        entries.append((_restricted_getattr, 'builtins.getattr'))
    except ImportError:  # pragma: no cover
        pass
    return entries


#: classes whose own plain functions may be fetched by :func:`_restricted_getattr`
_GETATTR_OWNERS: set = set()


def _restricted_getattr(owner, name):
    """Stand-in for ``builtins.getattr`` in weights-only unpickling: returns the plain (non-dunder)
    function ``name`` defined in the class body of an allowed owner class; refuses anything else.
    Fetching a function does not call it (the unpickler only calls allow-listed callables)."""
    if (isinstance(owner, type) and owner in _GETATTR_OWNERS and isinstance(name, str)
            and not name.startswith('__')
            and isinstance(vars(owner).get(name), types.FunctionType)):
        return vars(owner)[name]
    raise pickle.UnpicklingError(
        f'getattr({getattr(owner, "__qualname__", type(owner).__name__)!r}, {name!r}) is not '
        f'allowed in a safe checkpoint')


#: harmless globals allow-listed for ``weights_only`` loading, as ``(object, pickled name)``
SAFE_GLOBALS: List[Tuple[object, str]] = _build_safe_globals()


def allow_safe_globals() -> List[str]:
    """Register :data:`SAFE_GLOBALS` with ``torch.serialization.add_safe_globals``.

    Idempotent (torch keeps a set) and cheap, so it is called before every load; call it once at
    start-up to make plain ``torch.load`` (e.g. mmengine's ``--resume``) accept runner checkpoints
    with ``HistoryBuffer``/numpy objects. Returns the registered names.
    """
    torch.serialization.add_safe_globals(list(SAFE_GLOBALS))
    return [name for _, name in SAFE_GLOBALS]


# ----------------------------------------------------------------------------------------------
# safe_load
# ----------------------------------------------------------------------------------------------
def _unsafe_opt_in(allow_unsafe_pickle: Optional[bool]) -> bool:
    if allow_unsafe_pickle is not None:
        return bool(allow_unsafe_pickle)
    return os.environ.get(UNSAFE_PICKLE_ENV, '').strip().lower() in ('1', 'true', 'yes', 'on')


def resolve_model_url(filename):
    """``torchvision://NAME`` (the mmdet / mmseg shorthand for torchvision's ImageNet weights, e.g.
    ``torchvision://resnet50``) -> its download URL; anything else unchanged."""
    if isinstance(filename, str) and filename.startswith('torchvision://'):
        from mmengine.runner.checkpoint import get_torchvision_models
        name = filename[len('torchvision://'):]
        urls = get_torchvision_models()
        if name not in urls:
            raise CheckpointError(f"unknown torchvision model '{name}' in '{filename}'; known: "
                                  f"{', '.join(sorted(urls)[:20])}, ...")
        return urls[name]
    return filename


def _is_url(filename) -> bool:
    return isinstance(filename, str) and filename.startswith(('http://', 'https://'))


def _is_policy_rejection(exc: BaseException) -> bool:
    """True when torch's weights-only unpickler refused the content (as opposed to a broken file)."""
    msg = str(exc)
    return isinstance(exc, pickle.UnpicklingError) and (
        'Weights only load failed' in msg or 'WeightsUnpickler' in msg)


_CORRUPT_PATTERNS = ('PytorchStreamReader', 'zip archive', 'central directory', 'unexpected EOF',
                     'corrupted', 'Ran out of input', 'invalid load key', 'truncated')


def _is_corrupt_error(exc: BaseException) -> bool:
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(exc, (EOFError, zipfile.BadZipFile, OSError, KeyError, pickle.UnpicklingError)):
        return True
    return isinstance(exc, (RuntimeError, ValueError)) and any(
        p in str(exc) for p in _CORRUPT_PATTERNS)


def _offending_globals(path: Optional[str], exc: BaseException) -> List[str]:
    names: List[str] = []
    getter = getattr(torch.serialization, 'get_unsafe_globals_in_checkpoint', None)
    if getter is not None and path is not None and os.path.isfile(path):
        try:
            names = sorted(getter(path))
        except Exception:  # non-zip (legacy) files are not supported by the static scan
            names = []
    if not names:
        found = re.findall(r'GLOBAL ([\w.]+)', str(exc))
        found += re.findall(r"but got <class '([\w.]+)'>", str(exc))
        found += re.findall(r'unrecognized function <[^>]*?([\w.]+)>', str(exc))
        names = sorted(set(found))
    return names


def _unsafe_error(name: str, path: Optional[str], exc: BaseException) -> CheckpointError:
    offending = _offending_globals(path, exc)
    what = (f"pickles objects outside the safe allow-list: {', '.join(offending)}" if offending
            else 'uses pickle content the safe (weights_only) loader refuses')
    match = re.search(r'WeightsUnpickler error:\s*(.*?)\s*(?:Check the documentation|$)', str(exc),
                      re.S)
    detail = ' '.join((match.group(1) if match else str(exc).strip()).split())
    detail = detail.split(' Please use `torch.serialization.add_safe_globals')[0]
    return CheckpointError(
        f"Refusing to unpickle checkpoint '{name}': it {what}. Loading it would allow it to run "
        f"code. If (and only if) you trust this file, opt in with allow_unsafe_pickle=True or the "
        f"environment variable {UNSAFE_PICKLE_ENV}=1; better, convert it once into a tensors-only "
        f"file with linattn_mm.checkpoint.convert_checkpoint(..., allow_unsafe_pickle=True). "
        f"(torch: {detail[:500]})")


def _corrupt_error(path: str, exc: BaseException) -> CheckpointError:
    try:
        size = f'{os.path.getsize(path)} bytes'
    except OSError:
        size = 'unknown size'
    return CheckpointError(
        f"Checkpoint file '{path}' ({size}) is truncated or not a torch checkpoint "
        f"(incomplete download? re-download it): {type(exc).__name__}: {exc}")


def _warn_unsafe(name: str):
    warnings.warn(
        f"Loading checkpoint '{name}' with unrestricted unpickling (allow_unsafe_pickle / "
        f"{UNSAFE_PICKLE_ENV}): it can run arbitrary code; do this only for files you trust.",
        UnsafePickleWarning, stacklevel=3)


def safe_load(filename, map_location='cpu', allow_unsafe_pickle: Optional[bool] = None):
    """Load a checkpoint with ``torch.load(weights_only=True)`` after :func:`allow_safe_globals`.

    Args:
        filename: local path (str or ``os.PathLike``), an ``http(s)://`` URL (downloaded into the
            torch hub cache by ``torch.hub.load_state_dict_from_url``) or ``torchvision://NAME``.
        map_location: as for ``torch.load``.
        allow_unsafe_pickle: ``True`` retries a refused file with ``weights_only=False`` (emitting an
            :class:`UnsafePickleWarning`); ``False`` never does; ``None`` (default) follows the
            environment variable ``LINATTN_ALLOW_UNSAFE_PICKLE`` (``1``/``true``/``yes``/``on``).

    Returns:
        The unpickled object (usually a dict).

    Raises:
        FileNotFoundError: the local file does not exist.
        CheckpointError: the file pickles objects outside the allow-list (message names them and
            the opt-in), or it is truncated/corrupt/not a torch checkpoint (message names the file
            and its size).
    """
    allow_safe_globals()
    unsafe_ok = _unsafe_opt_in(allow_unsafe_pickle)
    filename = resolve_model_url(filename)
    if _is_url(filename):
        return _safe_load_url(filename, map_location, unsafe_ok)

    path = os.fspath(filename)
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, f'checkpoint file not found: {path}', path)
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint path '{path}' is a directory, not a checkpoint file")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        if _is_policy_rejection(exc):
            if not unsafe_ok:
                raise _unsafe_error(path, path, exc) from None
            _warn_unsafe(path)
            try:
                return torch.load(path, map_location=map_location, weights_only=False)
            except Exception as exc2:
                if _is_corrupt_error(exc2):
                    raise _corrupt_error(path, exc2) from exc2
                raise
        if _is_corrupt_error(exc):
            raise _corrupt_error(path, exc) from exc
        raise


def _safe_load_url(url: str, map_location, unsafe_ok: bool):
    """URL variant of :func:`safe_load` (same policy; the file is cached by torch.hub)."""
    cached = os.path.join(torch.hub.get_dir(), 'checkpoints', os.path.basename(urlparse(url).path))
    try:
        return torch.hub.load_state_dict_from_url(url, map_location=map_location,
                                                  weights_only=True)
    except Exception as exc:
        if _is_policy_rejection(exc):
            if not unsafe_ok:
                raise _unsafe_error(url, cached, exc) from None
            _warn_unsafe(url)
            return torch.hub.load_state_dict_from_url(url, map_location=map_location,
                                                      weights_only=False)
        if _is_corrupt_error(exc) and os.path.isfile(cached):
            raise CheckpointError(
                f"{_corrupt_error(cached, exc)} (downloaded from {url}; delete the cached file to "
                f"download it again)") from exc
        raise


# ----------------------------------------------------------------------------------------------
# unwrapping
# ----------------------------------------------------------------------------------------------
def _has_tensors(d) -> bool:
    return isinstance(d, Mapping) and any(isinstance(v, torch.Tensor) for v in d.values())


def _extract(ckpt, prefer_ema: bool = True):
    """Return ``(state_dict, source, non_tensor_keys)``; see :func:`extract_state_dict`."""
    if isinstance(ckpt, torch.nn.Module):
        return dict(ckpt.state_dict()), 'module.state_dict()', []
    if not isinstance(ckpt, Mapping):
        raise CheckpointError(
            f'expected a checkpoint dict, got {type(ckpt).__name__}')
    top_keys = list(ckpt.keys())
    current, path = ckpt, []
    # without prefer_ema, EMA weights are still used when they are the only weights in the file
    candidates = (_EMA_KEYS + _WRAPPER_KEYS) if prefer_ema else (_WRAPPER_KEYS + _EMA_KEYS)
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
            f'{_fmt_keys(top_keys, 20)}); expected a state dict, or a dict with one of '
            f'{list(_WRAPPER_KEYS) + list(_EMA_KEYS)}')
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
    sd, source, non_tensor = _extract(ckpt, prefer_ema)
    if non_tensor:
        warnings.warn(f"extract_state_dict: removed {len(non_tensor)} non-tensor entr"
                      f"{'y' if len(non_tensor) == 1 else 'ies'} from '{source}': "
                      f'{_fmt_keys(non_tensor, 20)}', stacklevel=2)
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
            f"{_fmt_keys(list(sd), 8)}); pass the right prefix (or prefix='' for none)")
    return kept, dropped


# ----------------------------------------------------------------------------------------------
# resizers
# ----------------------------------------------------------------------------------------------
ResizerFn = Callable[[str, torch.Tensor, torch.Size],
                     Union[torch.Tensor, Tuple[torch.Tensor, str]]]
_RESIZERS: List[Tuple['re.Pattern', ResizerFn]] = []


def register_resizer(pattern: str):
    """Decorator registering ``fn(key, src, dst_shape) -> Tensor`` for checkpoint keys matching the
    regex ``pattern`` (``re.search``).

    The function receives the checkpoint tensor and the model's shape and returns a tensor of
    exactly ``dst_shape``, or ``(tensor, note)`` where ``note`` is recorded in
    ``LoadReport.notes``. It raises :class:`CheckpointError` when the conversion is impossible.
    Resizers registered later are tried first.
    """
    regex = re.compile(pattern)

    def decorator(fn: ResizerFn) -> ResizerFn:
        _RESIZERS.insert(0, (regex, fn))
        return fn

    return decorator


def registered_resizers() -> List[Tuple[str, str]]:
    """``(pattern, function name)`` of the registered resizers, in the order they are tried."""
    return [(rx.pattern, getattr(fn, '__name__', repr(fn))) for rx, fn in _RESIZERS]


def resize_tensor(key: str, src: torch.Tensor, dst_shape) -> Optional[Tuple[torch.Tensor, str]]:
    """Apply the first registered resizer matching ``key``.

    Returns ``(tensor, note)`` (``note`` may be ``''``) or ``None`` when no resizer matches.
    Raises :class:`CheckpointError` when the resizer returns a wrong shape.
    """
    dst_shape = torch.Size(dst_shape)
    for regex, fn in _RESIZERS:
        if regex.search(key):
            out = fn(key, src, dst_shape)
            note = ''
            if isinstance(out, tuple):
                out, note = out
            if not isinstance(out, torch.Tensor) or out.shape != dst_shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise CheckpointError(
                    f"resizer {getattr(fn, '__name__', fn)} for '{key}' returned {got}, expected "
                    f'{tuple(dst_shape)}')
            return out, note or ''
    return None


def _interp(grid: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    """Bicubic (align_corners=False) resize of a (N, C, H, W) tensor, computed in float32."""
    if tuple(grid.shape[-2:]) == tuple(size):
        return grid
    dtype = grid.dtype
    work = grid.float() if dtype in (torch.float16, torch.bfloat16) or not dtype.is_floating_point \
        else grid
    return F.interpolate(work, size=size, mode='bicubic', align_corners=False).to(dtype)


def _split_tokens(key: str, length: int, max_extra: int, what: str) -> Tuple[int, int]:
    """Split a token count into ``(extra tokens, grid side)``: length = extra + side**2."""
    side = math.isqrt(length)
    extra = length - side * side
    if side == 0 or extra > max_extra:
        raise CheckpointError(
            f"'{key}': {what} length {length} is not a square grid"
            + (f' plus at most {max_extra} extra (class) tokens' if max_extra else '')
            + '; register a resizer for this key')
    return extra, side


def _grid_resize(key: str, src: torch.Tensor, dst_shape: torch.Size, max_extra: int):
    """Shared body of the absolute-position-embedding resizers (see :func:`resize_pos_embed`)."""
    notes = []
    # ---- source -> extra tokens (E, C) + grid (1, C, H, W)
    if src.dim() == 4:
        if src.shape[0] != 1:
            raise CheckpointError(f"'{key}': expected batch dim 1, got {tuple(src.shape)}")
        channels = src.shape[1]
        extra_src = src.new_zeros((0, channels))
        grid = src
    elif src.dim() in (2, 3):
        tokens = src
        if src.dim() == 3:
            if src.shape[0] != 1:
                raise CheckpointError(f"'{key}': expected batch dim 1, got {tuple(src.shape)}")
            tokens = src[0]
        channels = tokens.shape[1]
        n_extra, side = _split_tokens(key, tokens.shape[0], max_extra, 'checkpoint')
        extra_src = tokens[:n_extra]
        grid = tokens[n_extra:].reshape(side, side, channels).permute(2, 0, 1).unsqueeze(0)
    else:
        raise CheckpointError(f"'{key}': unsupported position-embedding shape {tuple(src.shape)}")
    # ---- destination layout
    if len(dst_shape) == 4:
        if dst_shape[0] != 1:
            raise CheckpointError(f"'{key}': model shape {tuple(dst_shape)} has batch dim != 1")
        dst_channels, size, n_extra_dst = dst_shape[1], (dst_shape[2], dst_shape[3]), 0
    elif len(dst_shape) in (2, 3):
        if len(dst_shape) == 3 and dst_shape[0] != 1:
            raise CheckpointError(f"'{key}': model shape {tuple(dst_shape)} has batch dim != 1")
        dst_channels = dst_shape[-1]
        n_extra_dst, side_dst = _split_tokens(key, dst_shape[-2], max_extra, 'model')
        size = (side_dst, side_dst)
    else:
        raise CheckpointError(f"'{key}': unsupported model shape {tuple(dst_shape)}")
    if dst_channels != channels:
        raise CheckpointError(
            f"'{key}': embedding dim differs (checkpoint {tuple(src.shape)}, model "
            f'{tuple(dst_shape)}); cannot be resized')
    if tuple(grid.shape[-2:]) != tuple(size):
        notes.append(f'grid {grid.shape[-2]}x{grid.shape[-1]} -> {size[0]}x{size[1]} (bicubic)')
    grid = _interp(grid, size)
    # ---- extra (class / distillation) tokens
    n_src = extra_src.shape[0]
    keep = min(n_src, n_extra_dst)
    extra = extra_src[:keep]
    if n_src > n_extra_dst:
        notes.append(f'dropped {n_src - n_extra_dst} extra token row(s) (class/dist token)')
    elif n_extra_dst > n_src:
        extra = torch.cat([extra, extra_src.new_zeros((n_extra_dst - n_src, channels))], 0)
        notes.append(f'added {n_extra_dst - n_src} zero-initialised extra token row(s)')
    if len(dst_shape) == 4:
        out = grid
    else:
        out = torch.cat([extra, grid[0].permute(1, 2, 0).reshape(-1, channels)], 0)
        out = out.reshape(dst_shape)
    return out.contiguous(), '; '.join(notes)


@register_resizer(r'(pos_embed\d*|absolute_pos_embed)$')
def resize_pos_embed(key: str, src: torch.Tensor, dst_shape: torch.Size):
    """Absolute position embeddings ``(1, E + h*w, C)`` (E in {0, 1, 2} class/dist tokens) or
    ``(1, C, H, W)``: bicubic resize (align_corners=False) of the square grid; the first
    ``min(E_src, E_dst)`` extra rows are kept, surplus checkpoint rows are dropped and missing ones
    zero-initialised (both noted in the report)."""
    return _grid_resize(key, src, dst_shape, max_extra=2)


@register_resizer(r'positional_encoding$')
def resize_positional_encoding(key: str, src: torch.Tensor, dst_shape: torch.Size):
    """PolaFormer-style per-block position encodings ``(1, h*w, C)``: bicubic grid resize, no extra
    tokens."""
    return _grid_resize(key, src, dst_shape, max_extra=0)


@register_resizer(r'(^|\.)attn\.p[12]$')
def resize_poly_tables(key: str, src: torch.Tensor, dst_shape: torch.Size):
    """Poly-SA pooling / spreading tables ``(1, E + h*w, heads)`` (E in {0, 1}): bicubic grid
    resize like a position embedding. ``p2`` is a weighted mean over the grid, so its grid part is
    also scaled by (checkpoint positions / model positions), keeping its sum."""
    out, note = _grid_resize(key, src, dst_shape, max_extra=1)
    if key.endswith('p2'):
        n_src = _split_tokens(key, src.shape[-2], 1, 'checkpoint')[1] ** 2
        e_dst, side = _split_tokens(key, dst_shape[-2], 1, 'model')
        if n_src != side * side:
            out = out.clone()
            out[..., e_dst:, :] *= n_src / (side * side)
            note = '; '.join(n for n in (note, f'grid part scaled by {n_src}/{side * side}') if n)
    return out, note


@register_resizer(r'relative_position_bias_table$')
def resize_relative_position_bias_table(key: str, src: torch.Tensor, dst_shape: torch.Size):
    """Swin relative position bias tables ``((2W-1)**2, nH)``: each head's ``(2W-1)x(2W-1)`` table
    is resized bicubically (align_corners=False). A head-count mismatch is an error."""
    if src.dim() != 2 or len(dst_shape) != 2:
        raise CheckpointError(
            f"'{key}': expected 2-D tables, got checkpoint {tuple(src.shape)} / model "
            f'{tuple(dst_shape)}')
    if src.shape[1] != dst_shape[1]:
        raise CheckpointError(
            f"'{key}': number of heads differs (checkpoint {tuple(src.shape)} has {src.shape[1]}, "
            f'model {tuple(dst_shape)} has {dst_shape[1]}); cannot be resized')
    s1, s2 = math.isqrt(src.shape[0]), math.isqrt(dst_shape[0])
    if s1 * s1 != src.shape[0] or s2 * s2 != dst_shape[0]:
        raise CheckpointError(
            f"'{key}': table lengths {src.shape[0]} / {dst_shape[0]} are not squares")
    heads = src.shape[1]
    grid = src.permute(1, 0).reshape(1, heads, s1, s1)
    out = _interp(grid, (s2, s2)).reshape(heads, s2 * s2).permute(1, 0).contiguous()
    return out, f'table {s1}x{s1} -> {s2}x{s2} per head (bicubic)'


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def _fmt_keys(keys: Iterable[str], limit: int = 10) -> str:
    keys = list(keys)
    shown = ', '.join(repr(k) for k in keys[:limit])
    return shown + (f', ... (+{len(keys) - limit} more)' if len(keys) > limit else '')


@dataclass
class LoadReport:
    """What a :func:`load_pretrained` / :func:`convert_checkpoint` call did.

    Attributes:
        source: key path the state dict came from (``'model_ema'``, ``'state_dict'``, ``'raw'``...).
        loaded: keys copied into the model (or written, for conversion).
        missing: model keys the checkpoint did not provide.
        unexpected: checkpoint keys the model does not have (not loaded).
        resized: key -> (checkpoint shape, model shape) for tensors adapted by a resizer.
        dropped: key -> reason for checkpoint keys removed on purpose (heads, buffers, prefixes...).
        non_tensor: non-tensor entries removed from the state dict.
        notes: key -> remark from a resizer (e.g. a dropped class-token row).
        checkpoint: name of the checkpoint (path/URL or ``'<in-memory dict>'``).
    """
    source: str = ''
    loaded: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    resized: Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]] = field(default_factory=dict)
    dropped: Dict[str, str] = field(default_factory=dict)
    non_tensor: List[str] = field(default_factory=list)
    notes: Dict[str, str] = field(default_factory=dict)
    checkpoint: str = ''

    @property
    def ok(self) -> bool:
        """True when nothing is missing or unexpected."""
        return not self.missing and not self.unexpected

    def summary(self, limit: int = 20) -> str:
        """Multi-line human-readable summary; each key list is truncated to ``limit`` entries."""
        lines = [f"Pretrained checkpoint '{self.checkpoint}' (state dict from '{self.source}'): "
                 f'{len(self.loaded)} loaded, {len(self.resized)} resized, {len(self.missing)} '
                 f'missing, {len(self.unexpected)} unexpected, {len(self.dropped)} dropped, '
                 f'{len(self.non_tensor)} non-tensor removed']

        def section(title, items):
            items = list(items)
            if not items:
                return
            lines.append(f'  {title} ({len(items)}):')
            for item in items[:limit]:
                lines.append(f'    {item}')
            if len(items) > limit:
                lines.append(f'    ... (+{len(items) - limit} more)')

        section('missing in checkpoint (left at initialisation)', self.missing)
        section('unexpected in checkpoint (not loaded)', self.unexpected)
        section('resized', [
            f'{k}: {tuple(old)} -> {tuple(new)}' + (f' [{self.notes[k]}]' if self.notes.get(k)
                                                    else '')
            for k, (old, new) in self.resized.items()])
        other_notes = {k: v for k, v in self.notes.items() if k not in self.resized}
        section('notes', [f'{k}: {v}' for k, v in other_notes.items()])
        by_reason: Dict[str, List[str]] = collections.OrderedDict()
        for k, reason in self.dropped.items():
            by_reason.setdefault(reason, []).append(k)
        section('dropped', [f'{reason}: {len(ks)} key(s): {_fmt_keys(ks, 6)}'
                            for reason, ks in by_reason.items()])
        section('non-tensor entries removed', self.non_tensor)
        return '\n'.join(lines)


# ----------------------------------------------------------------------------------------------
# pipeline
# ----------------------------------------------------------------------------------------------
def _ckpt_name(checkpoint) -> str:
    if isinstance(checkpoint, (str, os.PathLike)):
        return os.fspath(checkpoint)
    return '<in-memory dict>'


def _load_any(checkpoint, map_location, allow_unsafe_pickle):
    if isinstance(checkpoint, (Mapping, torch.nn.Module)):
        return checkpoint
    return safe_load(checkpoint, map_location=map_location,
                     allow_unsafe_pickle=allow_unsafe_pickle)


def _apply_model_pipeline(model: torch.nn.Module, sd: Dict[str, torch.Tensor], report: LoadReport,
                          name: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor],
                                              List['re.Pattern']]:
    """Hook, ignore patterns, matching and resizing against ``model`` (no loading).

    Returns ``(matched, model_state, ignore_patterns)`` where ``matched`` holds the tensors to load
    (already in the model's shapes); fills ``report.unexpected/dropped/resized/notes``.
    """
    hook = getattr(model, 'convert_pretrained_state_dict', None)
    if callable(hook):
        new_sd = hook(sd)
        if not isinstance(new_sd, Mapping):
            raise CheckpointError(
                f'{type(model).__name__}.convert_pretrained_state_dict must return a dict, got '
                f'{type(new_sd).__name__}')
        sd = collections.OrderedDict(new_sd)
    model_state = model.state_dict()
    model_ignore = [re.compile(p) for p in getattr(model, 'pretrained_ignore_keys', ()) or ()]
    buffer_ignore = [re.compile(p) for p in DEFAULT_IGNORE_BUFFER_KEYS]
    head_keys = [re.compile(p) for p in DEFAULT_HEAD_KEYS]

    kept = collections.OrderedDict()
    for k, v in sd.items():
        if any(rx.search(k) for rx in model_ignore):
            report.dropped[k] = f"{type(model).__name__}.pretrained_ignore_keys"
        elif any(rx.search(k) for rx in buffer_ignore):
            report.dropped[k] = 'recomputed buffer'
        elif (any(rx.search(k) for rx in head_keys)
              and not (k in model_state and model_state[k].shape == v.shape)):
            report.dropped[k] = 'classifier head of the source model'
        else:
            kept[k] = v

    matched_keys = [k for k in kept if k in model_state]
    if not matched_keys:
        raise CheckpointError(
            f"checkpoint '{name}' matches none of the model's {len(model_state)} parameters/"
            f"buffers ({type(model).__name__}). Checkpoint keys ({len(kept)} after unwrapping "
            f"'{report.source}'): {_fmt_keys(list(kept), 6)}; model keys: "
            f'{_fmt_keys(list(model_state), 6)}. If the weights sit under a prefix, pass it as '
            f"prefix='backbone.' (or whatever it is); a renaming belongs in "
            f'{type(model).__name__}.convert_pretrained_state_dict.')
    report.unexpected = [k for k in kept if k not in model_state]

    matched = collections.OrderedDict()
    for k in matched_keys:
        v, target = kept[k], model_state[k]
        if v.shape != target.shape:
            res = resize_tensor(k, v, target.shape)
            if res is None:
                raise CheckpointError(
                    f"shape mismatch for '{k}' in checkpoint '{name}': checkpoint "
                    f'{tuple(v.shape)} vs model {tuple(target.shape)}, and no resizer is '
                    f'registered for this key (see linattn_mm.checkpoint.register_resizer, or list '
                    f'it in {type(model).__name__}.pretrained_ignore_keys)')
            new, note = res
            report.resized[k] = (tuple(v.shape), tuple(target.shape))
            if note:
                report.notes[k] = note
            v = new
        matched[k] = v
    ignore_all = model_ignore + buffer_ignore
    return matched, model_state, ignore_all


def load_pretrained(model: torch.nn.Module, checkpoint, prefix: Optional[str] = None,
                    map_location='cpu', allow_unsafe_pickle: Optional[bool] = None,
                    prefer_ema: bool = True, strict: bool = False,
                    logger=None) -> LoadReport:
    """Load pretrained weights into ``model`` safely and report exactly what happened.

    Args:
        model: the module to fill (typically a backbone).
        checkpoint: path, ``http(s)://`` URL, or an already-loaded checkpoint dict.
        prefix: see :func:`strip_prefixes` (``None`` auto-detects mmpretrain/mmdet ``backbone.``
            files, unless the model itself has ``backbone.`` keys).
        map_location, allow_unsafe_pickle: see :func:`safe_load`.
        prefer_ema: use EMA weights (``model_ema``/``state_dict_ema``) when present.
        strict: raise when any model key is missing or any checkpoint key is unexpected (checked
            before anything is copied into the model).
        logger: where the summary goes, via ``mmengine.logging.print_log`` (WARNING level when
            keys are missing/unexpected, INFO otherwise); ``None`` means mmengine's current logger.

    Pipeline: :func:`safe_load` -> :func:`extract_state_dict` -> :func:`strip_prefixes` ->
    ``model.convert_pretrained_state_dict(sd)`` (if defined) -> drop keys matching
    ``model.pretrained_ignore_keys`` and :data:`DEFAULT_IGNORE_BUFFER_KEYS`, and
    :data:`DEFAULT_HEAD_KEYS` unless the model has them with the same shape -> registered resizers
    for shape mismatches -> ``model.load_state_dict(strict=False)``.

    Raises:
        CheckpointError: nothing matches the model; a shape mismatch without resizer; ``strict``
            violations; plus everything :func:`safe_load` raises.
    """
    name = _ckpt_name(checkpoint)
    ckpt = _load_any(checkpoint, map_location, allow_unsafe_pickle)
    sd, source, non_tensor = _extract(ckpt, prefer_ema)
    report = LoadReport(source=source, non_tensor=non_tensor, checkpoint=name)

    model_keys = model.state_dict().keys()
    if prefix is None and any(k.startswith('backbone.') for k in model_keys):
        prefix = ''  # the model itself is a full detector/classifier: no auto-strip
    sd, dropped = strip_prefixes(sd, prefix)
    report.dropped.update(dropped)

    matched, model_state, ignore = _apply_model_pipeline(model, sd, report, name)
    report.missing = [k for k in model_state
                      if k not in matched and not any(rx.search(k) for rx in ignore)]
    report.loaded = list(matched)

    if strict and (report.missing or report.unexpected):
        raise CheckpointError(
            f"strict loading of '{name}' into {type(model).__name__} failed: "
            f'{len(report.missing)} missing key(s) {_fmt_keys(report.missing, 20)}; '
            f'{len(report.unexpected)} unexpected key(s) {_fmt_keys(report.unexpected, 20)}')

    result = model.load_state_dict(matched, strict=False)
    leftover = [k for k in result.unexpected_keys]
    if leftover:  # cannot happen (we only pass model keys) - but never hide it
        report.unexpected.extend(k for k in leftover if k not in report.unexpected)

    from mmengine.logging import print_log
    level = logging.WARNING if (report.missing or report.unexpected) else logging.INFO
    print_log(report.summary(), logger='current' if logger is None else logger, level=level)
    return report


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()  # do not save the whole storage of a view
    return t


def convert_checkpoint(src, dst, prefix: str = 'backbone.',
                       allow_unsafe_pickle: Optional[bool] = None, prefer_ema: bool = True,
                       model: Optional[torch.nn.Module] = None) -> LoadReport:
    """Convert an official checkpoint offline into a tensors-only mmengine-style file.

    Steps: :func:`safe_load` (same opt-in policy) -> :func:`extract_state_dict` ->
    :func:`strip_prefixes` (auto ``module.``/``backbone.`` handling) -> drop classifier heads
    (:data:`DEFAULT_HEAD_KEYS`). With ``model`` the state dict additionally goes through the same
    hook / ignore / resize / validation steps as :func:`load_pretrained` (nothing is loaded; keys
    the model lacks are reported as unexpected and not written).

    The output ``{'state_dict': {prefix + key: tensor}, 'meta': {'converted_from': basename,
    'source_key': ...}}`` holds only plain tensors and strings, so it loads with
    ``torch.load(weights_only=True)`` without any allow-list, e.g. through stock mmengine
    ``init_cfg=dict(type='Pretrained', checkpoint=dst, prefix='backbone.')``.

    Returns:
        a :class:`LoadReport` (``loaded`` = keys written, without ``prefix``).
    """
    name = _ckpt_name(src)
    ckpt = _load_any(src, 'cpu', allow_unsafe_pickle)
    sd, source, non_tensor = _extract(ckpt, prefer_ema)
    report = LoadReport(source=source, non_tensor=non_tensor, checkpoint=name)
    sd, dropped = strip_prefixes(sd, None)
    report.dropped.update(dropped)
    if model is not None:
        out, model_state, ignore = _apply_model_pipeline(model, sd, report, name)
        report.missing = [k for k in model_state
                          if k not in out and not any(rx.search(k) for rx in ignore)]
    else:
        heads = [re.compile(p) for p in DEFAULT_HEAD_KEYS]
        out = collections.OrderedDict()
        for k, v in sd.items():
            if any(rx.search(k) for rx in heads):
                report.dropped[k] = 'classifier head of the source model'
            else:
                out[k] = v
    if not out:
        raise CheckpointError(f"nothing left to write from '{name}' after dropping heads")
    report.loaded = list(out)
    state = {f'{prefix}{k}': _plain_tensor(v) for k, v in out.items()}
    meta = {'converted_from': os.path.basename(name), 'source_key': str(source)}
    dst = os.fspath(dst)
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = dst + '.tmp'
    torch.save({'state_dict': state, 'meta': meta}, tmp)
    os.replace(tmp, dst)
    return report
