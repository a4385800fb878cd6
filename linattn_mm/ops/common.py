"""Pieces shared by the torch kernels of :mod:`linattn_mm.ops`."""
import warnings

import numpy as np
import torch

__all__ = ['grad_needed', 'sign_split', 'TRITON_FAILURE', 'note_triton_failure', 'use_triton',
           'call_triton', 'linear_into', 'chunked_layer_setup', 'MIN_CHUNK_ROWS', 'inference_call',
           'cpu_inference_call', 'log2_', 'NUMPY_LOG2_MAX_THREADS', 'fast_form_selected']

#: the first error of an automatically selected Triton call in this process; from then on the
#: modules run their torch kernels (a failing compiler or driver never stops inference)
TRITON_FAILURE = []


def note_triton_failure(owner, exc):
    """Record ``exc`` of an automatically selected Triton call in :data:`TRITON_FAILURE` and warn
    that the torch kernel takes over."""
    TRITON_FAILURE.append(f'{type(exc).__name__}: {exc}')
    warnings.warn(f'{owner}: the Triton kernel failed ({TRITON_FAILURE[0][:500]}); the torch '
                  f"kernel runs instead for the rest of this process (fused='triton' raises the "
                  f'error)', stacklevel=3)


def grad_needed(*tensors):
    """True when autograd is on and any of ``tensors`` (None entries allowed) requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def inference_call(module, x):
    """True when ``module`` processes ``x`` in inference: eval mode, no autocast on the device of
    ``x``, and no gradient needed for ``x`` or the module's parameters (the condition of the
    in-place and in-cache inference forms)."""
    return (not module.training and not torch.is_autocast_enabled(x.device.type)
            and not grad_needed(x, *module.parameters()))


def fast_form_selected(owner, name, setting, find_problem):
    """Whether a module's optional fast form runs, from its switch ``setting`` (attribute
    ``name``): False never; None when ``find_problem()`` finds nothing (it returns a sentence
    naming what prevents the fast form, or None); True always, and a ``RuntimeError`` that names
    the problem where the fast form cannot run. Any other value is an error too."""
    if setting is False:
        return False
    problem = (f'{name} must be None, True or False, got {setting!r}'
               if setting not in (None, True) else find_problem())
    if problem is None:
        return True
    if setting is not None:
        raise RuntimeError(f'{owner}: {problem}')
    return False


def cpu_inference_call(module, x):
    """:func:`inference_call` on CPU, with every parameter of the module in the dtype of ``x``."""
    return (x.device.type == 'cpu' and all(t.dtype == x.dtype for t in module.parameters())
            and inference_call(module, x))


def linear_into(inp, weight, bias, out):
    """``inp @ weight^T (+ bias)`` written into ``out`` (no new buffer; no autograd graph)."""
    if bias is None:
        return torch.mm(inp, weight.t(), out=out)
    return torch.addmm(bias, inp, weight.t(), out=out)


#: fewest tokens per chunk of the chunked layers when the chunk size follows the width
MIN_CHUNK_ROWS = 256


def chunked_layer_setup(name, x, num_heads, rows, default_rows, chunk_elements, even_head_dim,
                        *params):
    """Shapes and input checks of the chunked inference layers (:mod:`linattn_mm.ops.pola`,
    :mod:`linattn_mm.ops.nala`): ``x`` (B, N, C) in ``num_heads`` heads, ``rows`` tokens per chunk
    (``None``: ``default_rows``, and if that is None too ``chunk_elements // C`` tokens, at least
    :data:`MIN_CHUNK_ROWS`, so that a chunk's buffers have about the same size at every width).
    Returns ``(B, N, C, d, rows)``."""
    B, N, C = x.shape
    if rows is None:
        rows = default_rows if default_rows is not None else max(MIN_CHUNK_ROWS,
                                                                 chunk_elements // max(C, 1))
    d = C // num_heads
    if d * num_heads != C or (even_head_dim and d % 2):
        kind = 'an even' if even_head_dim else 'a whole'
        raise ValueError(f'{name}: {C} channels in {num_heads} heads do not give {kind} head dim')
    if grad_needed(x, *params):
        raise RuntimeError(f'{name} is forward-only; a gradient is needed here')
    rows = min(rows, N)
    if rows < 1:
        raise ValueError(f'{name}: rows must be positive, got {rows}')
    return B, N, C, d, rows


def sign_split(c):
    """``[relu(c), relu(-c)]`` (..., 2d) of a signed tensor ``c`` (..., d), written into one new
    contiguous buffer with two ops (``clamp_min``, then ``relu(c) - c == relu(-c)``, exact).
    Inference form: ``out=`` writes make no autograd graph."""
    d = c.shape[-1]
    out = torch.empty(*c.shape[:-1], 2 * d, dtype=c.dtype, device=c.device)
    pos = torch.clamp_min(c, 0, out=out[..., :d])
    torch.sub(pos, c, out=out[..., d:])
    return out


def use_triton(owner, fused, qkv, params=()):
    """Whether a mixer's call runs its Triton core. ``fused='triton'``: always, and a clear error
    where a gradient is needed (the kernels are forward-only). ``fused=None``: for CUDA ``qkv``
    of a supported dtype when no gradient is needed (``qkv`` and ``params``) and no automatic
    Triton call has failed in this process (:data:`TRITON_FAILURE`). Any other ``fused``:
    never."""
    grad = grad_needed(*qkv, *params)
    if fused == 'triton':
        if grad:
            raise RuntimeError(f"{owner}: fused='triton' is forward-only (no gradient); train "
                               f'with fused=None or True, or run under torch.no_grad()')
        return True
    if fused is not None or not qkv[0].is_cuda or grad or TRITON_FAILURE:
        return False
    from . import pola_triton
    return pola_triton.triton_available(qkv[0]) and all(
        t.dtype in pola_triton.TRITON_DTYPES for t in qkv)


def call_triton(owner, fused, core, *args, **kwargs):
    """``core(*args, **kwargs)`` for a Triton core chosen by :func:`use_triton`. Should it fail
    on the automatic path (``fused=None``: compiler, driver), the error is noted
    (:func:`note_triton_failure`) and None is returned, so the caller runs its torch kernel;
    with ``fused='triton'`` the error is raised."""
    try:
        return core(*args, **kwargs)
    except Exception as e:
        if fused == 'triton':
            raise
        note_triton_failure(owner, e)
        return None


#: :func:`log2_` takes numpy's log2 on CPU when torch runs this many threads or fewer (one thread,
#: float32, 131 k elements: torch 131 us, numpy 31 us; two threads: torch 72 us; numpy's ufunc
#: runs on one thread, torch's splits the tensor over its threads)
NUMPY_LOG2_MAX_THREADS = 4


def log2_(t):
    """``t.log2_()`` for a tensor that needs no gradient. On CPU in float32 / float64 with at
    most :data:`NUMPY_LOG2_MAX_THREADS` torch threads it runs numpy's vectorised log2 in place on
    the same memory (torch's CPU log2 is not vectorised: about 1 ns an element); ``log2(0)`` is
    ``-inf`` either way, without numpy's divide-by-zero warning. Tensor subclasses (fake tensors
    of tracing and export) and code being compiled keep torch's op."""
    if (type(t) is torch.Tensor and t.device.type == 'cpu'
            and t.dtype in (torch.float32, torch.float64)
            and torch.get_num_threads() <= NUMPY_LOG2_MAX_THREADS
            and not torch.compiler.is_compiling()):
        a = t.numpy()
        with np.errstate(divide='ignore', invalid='ignore'):
            np.log2(a, out=a)
        return t
    return t.log2_()
