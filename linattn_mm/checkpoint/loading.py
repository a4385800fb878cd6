"""Safe reading of checkpoint files: local paths, URLs, the OpenMMLab name schemes and any other
scheme registered with mmengine's ``CheckpointLoader``.

Policy: ``torch.load(weights_only=True)`` inside :func:`~linattn_mm.checkpoint.safe_globals`, so
plain tensors and the known harmless objects load; anything else (arbitrary pickled code) is refused
with a :class:`CheckpointError` naming the offending globals, and loaded only on explicit opt-in
(``allow_unsafe_pickle=True`` or ``LINATTN_ALLOW_UNSAFE_PICKLE=1``), for files you trust.
"""
import errno
import os
import pickle
import re
import warnings
import zipfile
from typing import List, Optional
from urllib.parse import urlparse

import torch

from .allowlist import safe_globals
from .errors import CheckpointError, UnsafePickleWarning

__all__ = ['safe_load', 'resolve_model_url', 'UNSAFE_PICKLE_ENV']

#: environment variable that opts in to unrestricted unpickling (only for files you trust)
UNSAFE_PICKLE_ENV = 'LINATTN_ALLOW_UNSAFE_PICKLE'

#: OpenMMLab name schemes -> (what the names are, mmengine's function returning name -> URL)
_NAMED_SCHEMES = {
    'torchvision://': ('torchvision', 'get_torchvision_models'),
    'modelzoo://': ('torchvision', 'get_torchvision_models'),
    'open-mmlab://': ('open-mmlab', 'get_external_models'),
    'openmmlab://': ('open-mmlab', 'get_external_models'),
    'mmcls://': ('mmcls', 'get_mmcls_models'),
}


def _unsafe_opt_in(allow_unsafe_pickle: Optional[bool]) -> bool:
    if allow_unsafe_pickle is not None:
        return bool(allow_unsafe_pickle)
    return os.environ.get(UNSAFE_PICKLE_ENV, '').strip().lower() in ('1', 'true', 'yes', 'on')


def resolve_model_url(filename):
    """An OpenMMLab model name -> its download URL (or local file), from mmengine's tables:
    ``torchvision://NAME`` (also ``modelzoo://``; the mmdet / mmseg shorthand for torchvision's
    ImageNet weights, e.g. ``torchvision://resnet50``), ``open-mmlab://NAME`` (also
    ``openmmlab://``) and ``mmcls://NAME``. Anything else is returned unchanged.

    Raises:
        CheckpointError: the name is not in the table (message lists some known names).
    """
    if not isinstance(filename, str):
        return filename
    scheme = next((s for s in _NAMED_SCHEMES if filename.startswith(s)), None)
    if scheme is None:
        return filename
    from mmengine.runner import checkpoint as mm_ckpt
    kind, getter = _NAMED_SCHEMES[scheme]
    name = filename[len(scheme):]
    if kind == 'open-mmlab':
        name = mm_ckpt.get_deprecated_model_names().get(name, name)
    urls = getattr(mm_ckpt, getter)()
    if name not in urls:
        raise CheckpointError(f"unknown {kind} model '{name}' in '{filename}'; known: "
                              f"{', '.join(sorted(urls)[:20])}, ...")
    url = urls[name]
    if not _is_url(url):  # open-mmlab entries may name a file under mmengine's home
        url = os.path.join(mm_ckpt._get_mmengine_home(), url)
    return url


def _is_url(filename) -> bool:
    return isinstance(filename, str) and filename.startswith(('http://', 'https://'))


def _is_other_scheme(filename) -> bool:
    """``s3://``, ``petrel://``, ``pavi://`` or any scheme registered with ``CheckpointLoader``."""
    return isinstance(filename, str) and re.match(r'^(\S+:)?[A-Za-z][\w+.-]*://', filename) \
        is not None


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
        UnsafePickleWarning, stacklevel=4)


def safe_load(filename, map_location='cpu', allow_unsafe_pickle: Optional[bool] = None):
    """Load a checkpoint with ``torch.load(weights_only=True)`` inside
    :func:`~linattn_mm.checkpoint.safe_globals` (torch's allow-list is unchanged afterwards).

    Args:
        filename: local path (str or ``os.PathLike``); an ``http(s)://`` URL (downloaded into the
            torch hub cache by ``torch.hub.load_state_dict_from_url``); an OpenMMLab name
            (``torchvision://``, ``open-mmlab://``, ``mmcls://``, see :func:`resolve_model_url`); or
            any other scheme registered with mmengine's ``CheckpointLoader`` (``s3://``, ``pavi://``
            ...), read by that loader with torch's default ``weights_only=True``.
        map_location: as for ``torch.load``.
        allow_unsafe_pickle: ``True`` retries a refused file with ``weights_only=False`` (emitting an
            :class:`UnsafePickleWarning`; local files and URLs only); ``False`` never does; ``None``
            (default) follows the environment variable ``LINATTN_ALLOW_UNSAFE_PICKLE``
            (``1``/``true``/``yes``/``on``).

    Returns:
        The unpickled object (usually a dict).

    Raises:
        FileNotFoundError: the local file does not exist.
        CheckpointError: the file pickles objects outside the allow-list (message names them and
            the opt-in), or it is truncated/corrupt/not a torch checkpoint (message names the file
            and its size), or the name of an OpenMMLab scheme is unknown.
    """
    unsafe_ok = _unsafe_opt_in(allow_unsafe_pickle)
    filename = resolve_model_url(filename)
    with safe_globals():
        if _is_url(filename):
            return _safe_load_url(filename, map_location, unsafe_ok)
        if _is_other_scheme(filename):
            return _safe_load_scheme(filename, map_location, unsafe_ok)
        return _safe_load_file(filename, map_location, unsafe_ok)


def _safe_load_file(filename, map_location, unsafe_ok: bool):
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
    """URL variant of :func:`safe_load` (same policy; the file is cached by torch.hub). mmengine's
    own http loader is not used: it unpickles without ``weights_only``."""
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


def _torch_loads_weights_only_by_default() -> bool:
    """False when ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` makes a plain ``torch.load`` unpickle
    everything (a scheme loader of mmengine calls ``torch.load`` without ``weights_only``)."""
    def flag(name):
        return os.environ.get(name, '0').strip().lower() in ('1', 'y', 'yes', 'true')
    return flag('TORCH_FORCE_WEIGHTS_ONLY_LOAD') or not flag('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD')


def _safe_load_scheme(filename: str, map_location, unsafe_ok: bool):
    """Other schemes through mmengine's ``CheckpointLoader`` (its loaders call ``torch.load`` with
    torch's default, ``weights_only=True``)."""
    from mmengine.runner.checkpoint import CheckpointLoader
    if not unsafe_ok and not _torch_loads_weights_only_by_default():
        raise CheckpointError(
            f"Refusing to read '{filename}' through mmengine's CheckpointLoader: "
            f'TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set, so its torch.load would unpickle (and run) '
            f'anything in the file. Unset it, or opt in with allow_unsafe_pickle=True / '
            f'{UNSAFE_PICKLE_ENV}=1 for a file you trust.')
    try:
        return CheckpointLoader.load_checkpoint(filename, map_location=map_location)
    except Exception as exc:
        if _is_policy_rejection(exc):
            error = _unsafe_error(filename, None, exc)
            if unsafe_ok:
                error = CheckpointError(
                    f'{error} allow_unsafe_pickle applies to local files and http(s) URLs only: '
                    f'copy this file to a local path to load it with full unpickling.')
            raise error from None
        raise
