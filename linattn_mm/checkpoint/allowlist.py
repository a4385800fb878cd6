"""The unpickling allow-list: harmless objects that official and mmengine checkpoints pickle next
to their tensors, accepted by ``torch.load(weights_only=True)`` inside :func:`safe_globals`.

Since torch 2.6 ``torch.load`` defaults to ``weights_only=True``: only tensors, containers and an
allow-list of classes may be unpickled. Official checkpoints of the architectures this package ports
pickle a few harmless extra objects (an ``argparse.Namespace`` under ``'args'`` in DeiT/PVT files, a
yacs ``CfgNode`` under ``'config'`` in Swin/PolaFormer files, numpy scalars/arrays), and mmengine's
runner checkpoints hold ``HistoryBuffer`` objects in their ``message_hub``.

Importing linattn_mm does not touch torch's allow-list. :func:`safe_globals` adds
:data:`SAFE_GLOBALS` for the duration of a ``with`` block (every linattn_mm loader and the
``tools/train.py`` / ``tools/test.py`` runs use it;
:class:`~linattn_mm.checkpoint.hook.SafeGlobalsHook` does the same around an mmengine runner's
checkpoint loading). :func:`allow_safe_globals` is the explicit opt-in for a whole process.
"""
import argparse
import collections
import contextlib
import pickle
import types
from typing import List, Tuple

import torch

__all__ = ['SAFE_GLOBALS', 'safe_globals', 'allow_safe_globals']


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
    # pickle protocol 2 (torch.save's) writes an empty bytes object as the call ``bytes()``: an
    # empty numpy array (e.g. a fresh HistoryBuffer's) needs it. The stand-in makes only b''.
    entries.append((_empty_bytes, 'builtins.bytes'))
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


def _empty_bytes(*args):
    """Stand-in for ``builtins.bytes`` in weights-only unpickling: pickle protocol 2 writes
    ``b''`` as ``bytes()`` (non-empty bytes go through ``_codecs.encode``, which torch allows).
    Only that call is accepted: ``bytes(n)`` would let a small file allocate n bytes."""
    if args:
        raise pickle.UnpicklingError(f'bytes{args!r} is not allowed in a safe checkpoint (only '
                                     f"bytes(), the pickled form of b'')")
    return b''


#: harmless globals allow-listed for ``weights_only`` loading, as ``(object, pickled name)``
SAFE_GLOBALS: List[Tuple[object, str]] = _build_safe_globals()

#: set once :func:`allow_safe_globals` registered :data:`SAFE_GLOBALS` for the whole process
_process_wide = False


@contextlib.contextmanager
def safe_globals():
    """Context manager: inside the ``with`` block ``torch.load(weights_only=True)`` accepts
    :data:`SAFE_GLOBALS`; after it, torch's allow-list is what it was before.

    Built on ``torch.serialization.safe_globals``. Only the entries that are not allowed yet are
    added, and only those are removed on exit, so blocks nest and an earlier
    :func:`allow_safe_globals` (or the caller's own ``add_safe_globals``) stays in force. torch
    keeps one allow-list per process: while the block runs it applies to loads in every thread.
    """
    present = set(torch.serialization.get_safe_globals())
    new = [entry for entry in SAFE_GLOBALS if entry not in present]
    with contextlib.ExitStack() as stack:
        if new:
            stack.enter_context(torch.serialization.safe_globals(new))
        try:
            yield
        finally:
            if _process_wide:  # registered for the whole process inside the block: keep them
                stack.pop_all()


def allow_safe_globals() -> List[str]:
    """Explicit opt-in: register :data:`SAFE_GLOBALS` with ``torch.serialization.add_safe_globals``
    for the rest of the process, so that any plain ``torch.load`` (e.g. a script of your own that
    calls mmengine's loading functions outside a runner) accepts them.

    linattn_mm itself never calls this; its loaders and tools use :func:`safe_globals`, and configs
    run by stock tools get :class:`~linattn_mm.checkpoint.hook.SafeGlobalsHook`. Idempotent.
    Returns the registered names.
    """
    global _process_wide
    torch.serialization.add_safe_globals(list(SAFE_GLOBALS))
    _process_wide = True
    return [name for _, name in SAFE_GLOBALS]
