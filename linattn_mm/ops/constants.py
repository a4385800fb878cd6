"""Tensors that depend on shapes, a device and a dtype only (window layouts, shift masks,
interpolation matrices): made once per key and kept, so that a forward does not rebuild them
(each rebuild is a dozen small operations, and a table made on the host and moved to a GPU is a
copy that waits for the GPU)."""
import functools

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ['shape_constant', 'clear_shape_constants']

_CACHED = []


def shape_constant(maxsize):
    """Decorator: cache ``fn``'s result per arguments (hashable: ints, strings, devices, dtypes;
    the ``maxsize`` most recent keys are kept, as :func:`functools.lru_cache`).

    The result is made with inference mode off, so that a table first made under
    ``torch.inference_mode()`` (an inference run) can be saved for backward by a later training
    step; autograd does not track it (no input requires grad). Callers must not modify it in
    place: every later call gets the same tensors. While ``torch.compile`` traces, ``fn`` itself is
    traced (a cache is not something the compiler can trace), and under a fake tensor mode
    ``fn`` runs uncached (its result is a fake tensor)."""
    def wrap(fn):
        @functools.lru_cache(maxsize=maxsize)
        def cached(*args, **kwargs):
            with torch.inference_mode(False):
                return fn(*args, **kwargs)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            # traced into the graph while compiling (the compiler's constants); under a fake
            # tensor mode the result is a fake tensor, not to be kept for real calls
            if torch.compiler.is_compiling() or _fake_mode_active():
                return fn(*args, **kwargs)
            return cached(*args, **kwargs)
        call.cache_clear, call.cache_info = cached.cache_clear, cached.cache_info
        _CACHED.append(cached)
        return call
    return wrap


def _fake_mode_active():
    modes = _get_current_dispatch_mode_stack()
    if not modes:  # the common case: no mode, nothing to import
        return False
    from torch._subclasses.fake_tensor import FakeTensorMode
    return any(isinstance(m, FakeTensorMode) for m in modes)


def clear_shape_constants():
    """Drop every table kept by :func:`shape_constant` (they are remade on their next use): to
    free the memory of tables for sizes no longer in use, e.g. on a GPU after a run at many
    input sizes."""
    for fn in _CACHED:
        fn.cache_clear()
