"""Pieces shared by the torch kernels of :mod:`linattn_mm.ops`."""
import contextlib
import functools
import platform
import sys

import numpy as np
import torch

from linattn_mm.utils.autocast_meta import (meta_autocast_dtype, meta_autocast_enabled,
                                           meta_autocast_off)

__all__ = ['grad_needed', 'promote_types', 'into', 'sign_split', 'sign_split_dot', 'linear_into',
           'chunked_layer_setup', 'MIN_CHUNK_ROWS', 'core_chunk_rows', 'heads_buffer',
           'token_chunks', 'token_slice', 'numpy_log2_', 'numpy_log2_vectorised', 'NUMPY_LOG2',
           'NUMPY_LOG2_MAX_THREADS', 'core_dtype', 'no_autocast', 'autocast_on',
           'backward_without_autocast', 'token_chunk_rows',
           'TOKEN_CHUNK_ELEMENTS', 'TOKEN_MIN_ROWS', 'add_or_take', 'token_gram',
           'token_gram_parts', 'TOKENS_PER_GRAM_PART', 'in_dtype_of', 'kept_input',
           'autocast_dtype']


def grad_needed(*tensors):
    """True when autograd is on and any of ``tensors`` (None entries allowed) requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def promote_types(a, b):
    """``torch.promote_types(a, b)``, remembered: the torch function is an operator call (a trip
    through the dispatcher, counted by :class:`~linattn_mm.utils.OperationCounter`), and the
    cores ask it for the same few pairs of dtypes in every call (while ``torch.compile`` traces:
    the torch function, a constant there)."""
    if torch.compiler.is_compiling():
        return torch.promote_types(a, b)
    return _promote_types(a, b)


@functools.lru_cache(maxsize=None)
def _promote_types(a, b):
    return torch.promote_types(a, b)


def core_dtype(*tensors):
    """The dtype the attention cores compute in: float64 when any input is float64, else
    float32 (half-precision inputs are promoted: the feature maps' powers leave their range)."""
    work = torch.float32
    for t in tensors:
        if t is not None:
            work = promote_types(work, t.dtype)
    return work


def autocast_on(device):
    """Whether autocast is on for ``device``: on ``meta``, whether a
    :func:`~linattn_mm.utils.meta_autocast` region (CUDA's autocast emulated) is;
    False on other devices without autocast."""
    if device.type == 'meta':
        return meta_autocast_enabled()
    return torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)


def no_autocast(device):
    """A context with autocast off on ``device`` (the cores run in their own dtype); on ``meta``
    a :func:`~linattn_mm.utils.meta_autocast` region switched off; nothing to turn
    off on other devices without autocast."""
    if device.type == 'meta':
        return meta_autocast_off()
    if not torch.amp.is_autocast_available(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def backward_without_autocast(backward):
    """Decorator of a training Function's ``backward``: the body runs with autocast off on the
    gradient's device, as the backward of torch's own operations does, so that a ``backward()``
    called inside an autocast region (allowed, if not advised) computes what it computes outside
    one: the dtypes the forward saved, float32 products where the forward ran them."""
    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        device = next((g.device for g in grads if isinstance(g, torch.Tensor)), None)
        if device is None:
            return backward(ctx, *grads)
        with no_autocast(device):
            return backward(ctx, *grads)
    return wrapped


def linear_into(inp, weight, bias, out):
    """``inp @ weight^T (+ bias)`` written into ``out`` (no new buffer; no autograd graph)."""
    if bias is None:
        return torch.mm(inp, weight.t(), out=out)
    return torch.addmm(bias, inp, weight.t(), out=out)


#: fewest tokens per chunk of the chunked layers when the chunk size follows the width
MIN_CHUNK_ROWS = 256


def heads_buffer(like, tokens, dtype):
    """An empty (B, h, tokens, d) tensor that is a view of a (B, tokens, h, d) buffer (merging
    the heads of a result written into it is free)."""
    B, h, _, d = like.shape
    return torch.empty(B, tokens, h, d, dtype=dtype, device=like.device).transpose(1, 2)


def core_chunk_rows(name, q, rows, elements):
    """Tokens per chunk of a core's training form for (B, h, N, d) tensors like ``q``: ``rows``
    if given; on CPU ``elements // (B h d)``, at least :data:`MIN_CHUNK_ROWS` (a chunk's
    temporaries then stay in the core's caches instead of being fresh full-size maps); elsewhere
    all tokens in one chunk (a GPU gains nothing from cache-sized chunks, and many small launches
    cost time). ``name``: the core, for the error on a ``rows`` below 1."""
    if rows is None:
        B, h, N, d = q.shape
        if q.device.type != 'cpu':
            return max(N, 1)
        rows = max(MIN_CHUNK_ROWS, elements // max(B * h * d, 1))
    if rows < 1:
        raise ValueError(f'{name}: rows must be positive, got {rows}')
    return rows


def token_chunks(n, rows):
    """Slices of ``rows`` tokens covering ``n`` tokens (the cores' chunk loops)."""
    return [slice(i, min(i + rows, n)) for i in range(0, n, rows)]


def token_slice(t, sl, n, dtype=None):
    """Tokens ``sl`` of a (.., n, d) tensor broadcast over the tokens or not (None stays None), in
    ``dtype`` if given."""
    if t is None:
        return None
    if t.shape[-2] == n and n != 1:
        t = t[..., sl, :]
    return t if dtype is None else t.to(dtype)


#: values of one chunk of the training Functions that run over chunks of tokens on CPU
#: (:func:`token_chunk_rows`: the FFN halves, the gated output and the split projections): a
#: chunk's activations and gradients stay in the core's caches instead of being fresh full-size
#: maps
TOKEN_CHUNK_ELEMENTS = 2 ** 18
#: fewest tokens per chunk: each chunk adds a rank-``rows`` update to the weight gradients, which
#: must be amortised (at 1050 tokens of width 768, FFN chunks of 85 tokens made the backward 17 %
#: slower than one chunk)
TOKEN_MIN_ROWS = 1024


def token_chunk_rows(name, t, width, rows=None):
    """Tokens per chunk of a training Function over the tokens of ``t`` (..., C) whose widest
    per-token map has ``width`` values: ``rows`` if given; on CPU in float32 / float64 without
    autocast ``TOKEN_CHUNK_ELEMENTS // width``, at least :data:`TOKEN_MIN_ROWS`; else all tokens in
    one chunk (on CUDA the caching allocator reuses memory and one large GEMM is fastest; under
    autocast one chunk keeps the half-precision sums of the plain form). Never more than the
    tokens."""
    tokens = max(t.numel() // max(t.shape[-1], 1), 1)
    if rows is None:
        if (t.device.type != 'cpu' or t.dtype not in (torch.float32, torch.float64)
                or torch.is_autocast_enabled('cpu')):
            return tokens
        rows = max(TOKEN_MIN_ROWS, TOKEN_CHUNK_ELEMENTS // max(width, 1))
    if rows < 1:
        raise ValueError(f'{name}: rows must be positive, got {rows}')
    return min(tokens, rows)


def in_dtype_of(t, like):
    """``t`` in the dtype of ``like`` (None stays None): a gradient computed in a Function's
    working dtype, returned in the dtype of its input."""
    return None if t is None else t.to(like.dtype)


def kept_input(name, x, twin=None):
    """What a training Function keeps of its input ``x`` for backward: ``x``, or ``twin``, a
    lower-precision tensor of the same shape with ``twin.to(x.dtype) == x`` exactly (the backward
    casts it back), so that a float32 copy that feeds several Functions is not kept by each."""
    if twin is None:
        return x
    if twin.shape != x.shape:
        raise ValueError(f'{name}: the kept twin must have the input\'s shape {tuple(x.shape)}, '
                         f'got {tuple(twin.shape)}')
    return twin


def add_or_take(acc, t):
    """``acc += t`` for the sums over chunks (``acc`` None at the first chunk: ``t`` itself)."""
    return t if acc is None else acc.add_(t)


#: fewest tokens per part of :func:`token_gram` off CPU (None: one part everywhere)
TOKENS_PER_GRAM_PART = 2048


def token_gram_parts(t, tokens):
    """Parts of the sum over ``tokens`` tokens in :func:`token_gram` for operands like ``t``: one
    on CPU (the training Functions there already work over cache-sized chunks of tokens, each
    adding its own product) and for half-precision operands (their partial sums would each be
    rounded); elsewhere ``P = tokens // TOKENS_PER_GRAM_PART`` or, where one exists, the largest
    divisor of ``tokens`` between ``P / 2`` and ``P`` (parts of 2048 to 4096 tokens that leave
    none over: then a contiguous operand is cut into parts without a copy); one below 4096
    tokens.

    Why: these products have a small output (a (d, d + 2) matrix per head, or one part of a
    projection's weight gradient) and a long sum (all tokens of a stage-1 map: 67200 at
    800 x 1344), so a GEMM that does not split its sum runs on as few of the GPU's
    multiprocessors as the output has tiles. In a profile of a Pola-Swin-T training step on an
    H100 (float32, batch 1), 24 GEMMs with 32 x 32 tiles took 0.94 ms each, 18 % of the GPU time;
    the (B, h) products of the Pola core and the per-part weight gradients of
    :class:`~linattn_mm.ops.lean_layers.SplitLinear` are of that shape. In parts, one batched GEMM
    covers every part's tiles at once and a sum over the parts follows. On an H200 (same step)
    the parts took it from 74.4 to 54.4 ms (``docs/benchmarks.md``, "On a GPU: NVIDIA H200")."""
    if (TOKENS_PER_GRAM_PART is None or t.device.type == 'cpu'
            or t.dtype not in (torch.float32, torch.float64)):
        return 1
    most = tokens // TOKENS_PER_GRAM_PART
    for parts in range(most, (most + 1) // 2 - 1, -1):
        if parts > 1 and tokens % parts == 0:
            return parts
    return max(1, most)


def token_gram(a, b, acc=None):
    """``a^T b`` summed over the tokens: ``a`` (..., T, M), ``b`` (..., T, N) -> (..., M, N),
    added into ``acc`` in place when it is given (no autograd graph is needed by the callers).
    In :func:`token_gram_parts` parts: the first ``parts * (T // parts)`` tokens as one batched
    product of the parts, summed over them, plus the product of the tokens left over. The batched
    product copies an operand whose batch dims and parts cannot be one stride (a head-split view
    of a (B, N, h, d) map at batch 1; any operand of more than two dims when tokens are left
    over)."""
    T = a.shape[-2]
    parts = min(token_gram_parts(a, T), T)
    if parts <= 1:
        if acc is None:
            return a.transpose(-2, -1) @ b
        if a.dim() == 2:
            return acc.addmm_(a.t(), b)
        return acc.add_(a.transpose(-2, -1) @ b)
    L = T // parts
    main = parts * L
    split = torch.matmul(a[..., :main, :].unflatten(-2, (parts, L)).transpose(-2, -1),
                         b[..., :main, :].unflatten(-2, (parts, L)))
    out = split.sum(-3) if acc is None else acc.add_(split.sum(-3))
    if main < T:
        out.add_(a[..., main:, :].transpose(-2, -1) @ b[..., main:, :])
    return out


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


def into(fn, out, *args, **kwargs):
    """``fn(*args, out=out, **kwargs)``: the result written into ``out``, a view of a larger
    buffer (no new one). While ``torch.compile`` traces, which takes no ``out=`` view that is not
    contiguous, ``out.copy_(fn(*args, **kwargs))``, which the compiler fuses."""
    if torch.compiler.is_compiling():
        return out.copy_(fn(*args, **kwargs))
    return fn(*args, out=out, **kwargs)


def sign_split(c):
    """``[relu(c), relu(-c)]`` (..., 2d) of a signed tensor ``c`` (..., d), written into one new
    contiguous buffer with two ops (``clamp_min``, then ``relu(c) - c == relu(-c)``, exact).
    Forward form: ``out=`` writes make no autograd graph."""
    d = c.shape[-1]
    out = torch.empty(*c.shape[:-1], 2 * d, dtype=c.dtype, device=c.device)
    pos = into(torch.clamp_min, out[..., :d], c, 0)
    into(torch.sub, out[..., d:], pos, c)
    return out


def sign_split_dot(df, f):
    """``dc * c`` for ``f = sign_split(c)`` (..., 2d) and ``df`` the gradient of ``f``: the two
    halves of ``df * f`` summed (``relu(c) = c [c > 0]``, ``relu(-c) = -c [c < 0]``: the same
    products as ``dc`` taken through the sign split, then times ``c``). ``df`` is overwritten."""
    d = f.shape[-1] // 2
    gf = df.mul_(f)
    return torch.add(gf[..., :d], gf[..., d:])


def numpy_log2_vectorised():
    """Whether numpy's float32 and float64 ``log2`` run vectorised on this machine. numpy has
    SIMD loops for them only for AVX-512 (Intel's SVML, linked into its Linux x86-64 builds);
    elsewhere they loop over the C library's scalar ``log2``, slower than torch's. One thread,
    131 k elements: AVX-512 (AMD EPYC): numpy 31 us, torch 131 us (float32); AVX2 only (AMD
    EPYC): numpy 783 us, torch 189 us (float32), 718 against 388 us (float64).

    numpy 2 says which loop each function runs (``__cpu_targets_info__``: not the baseline one
    means SIMD); older numpy: an AVX-512 CPU (``AVX512_SKX``) on Linux x86-64."""
    try:
        from numpy._core import _multiarray_umath as umath
    except ImportError:  # numpy 1.x
        try:
            from numpy.core import _multiarray_umath as umath
        except ImportError:
            return False
    targets = getattr(umath, '__cpu_targets_info__', None)
    if isinstance(targets, dict) and isinstance(targets.get('log2'), dict):
        loops = targets['log2']
        return all(not str(loops.get(sig, {}).get('current', 'baseline')).startswith('baseline')
                   for sig in ('ff', 'dd'))
    features = getattr(umath, '__cpu_features__', {})
    return bool(features.get('AVX512_SKX') and sys.platform.startswith('linux')
                and platform.machine() in ('x86_64', 'AMD64'))


#: :func:`numpy_log2_` takes numpy's log2 where it is vectorised (:func:`numpy_log2_vectorised`,
#: decided once, at import) and torch runs at most :data:`NUMPY_LOG2_MAX_THREADS` threads
NUMPY_LOG2 = numpy_log2_vectorised()

#: :func:`numpy_log2_` takes numpy's log2 on CPU when torch runs this many threads or fewer (one
#: thread, float32, 131 k elements, AVX-512: torch 131 us, numpy 31 us; two threads: torch 72
#: us; numpy's ufunc runs on one thread, torch's splits the tensor over its threads)
NUMPY_LOG2_MAX_THREADS = 4


def numpy_log2_(t):
    """``t.log2_()`` for a tensor that needs no gradient, computed by numpy where that is faster.
    On CPU in float32 / float64, where numpy's log2 is vectorised (:data:`NUMPY_LOG2`) and torch
    runs at most :data:`NUMPY_LOG2_MAX_THREADS` threads, it runs numpy's log2 in place on the
    same memory (torch's CPU log2 is not vectorised: about 1 ns an element there); ``log2(0)`` is
    ``-inf`` either way, without numpy's divide-by-zero warning. Tensor subclasses (fake tensors
    of tracing and export), other devices, other machines and code being compiled run torch's
    op."""
    if (NUMPY_LOG2 and not torch.compiler.is_compiling() and type(t) is torch.Tensor
            and t.device.type == 'cpu' and t.dtype in (torch.float32, torch.float64)
            and torch.get_num_threads() <= NUMPY_LOG2_MAX_THREADS):
        a = t.numpy()
        with np.errstate(divide='ignore', invalid='ignore'):
            np.log2(a, out=a)
        return t
    return t.log2_()


def autocast_dtype(device):
    """The dtype autocast runs its lower-precision operations in on ``device`` (a
    :func:`~linattn_mm.utils.meta_autocast` region's on ``meta``), or None where it is off."""
    if not autocast_on(device):
        return None
    if device.type == 'meta':
        return meta_autocast_dtype()
    return torch.get_autocast_dtype(device.type)
