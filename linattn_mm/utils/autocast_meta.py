"""CUDA's autocast for ``meta`` tensors: what a GPU training step under ``--amp`` (bf16 / fp16)
reads, writes and keeps, counted on a machine without a GPU.

``torch.autocast`` has no ``meta`` device: meta tensors carry no autocast dispatch key, so a
model run on meta under autocast computes in float32. :func:`meta_autocast` gives them CUDA's
policy, at the same place in the dispatcher and with the same rules as CUDA's autocast kernels
(``aten/src/ATen/autocast_mode.h``, ``autocast_mode.cpp``):

* the operations of :data:`LOWER_PRECISION` (matrix products, convolutions, ``linear``, fused
  attention) cast their floating arguments (float64 excepted) to the autocast dtype; the casts of
  float32 leaves that need a gradient (the weights) are made once per autocast region and reused;
* those of :data:`FP32` (``exp``, ``log``, ``pow``, ``layer_norm``, the losses, ...) cast them to
  float32;
* those of :data:`FP32_SET_OPT_DTYPE` (``sum``, ``softmax``, ``cumsum``, ...) run with
  ``dtype=float32`` when their first argument is such a tensor and no dtype is given;
* ``norm`` (:data:`FP32_APPEND_DTYPE`) is redispatched to its overload with ``dtype=float32``;
* those of :data:`PROMOTE` (``addcmul``, ``index_put``, ...) cast their floating arguments to
  the widest of their dtypes.

How: the autocast key of a device the machine does not have (``AutocastXPU``, whose own kernels
cast only XPU tensors: they leave meta tensors as they are) is added to every dispatch while the
region is active, and kernels registered for that key over its own (``torch.library``, removed
again at the region's end) carry out CUDA's policy on meta tensors. The key sits above autograd,
as CUDA's does, so autograd records the casts (``ToCopyBackward``) and the backward runs in the
dtypes a GPU's does; like ``torch.autocast``, the region is meant for the forward (the backward
outside it). The plugin's own checks of
autocast (:func:`linattn_mm.ops.common.autocast_on`, ``no_autocast``) see the region as autocast
on the device ``meta``.

The operation lists are CUDA's for the installed torch: a test checks them against the kernels
registered for ``AutocastCUDA`` in the dispatcher, and the dtypes they give against CUDA's own
autocast kernels run on fake CUDA tensors.

Example::

    with TrafficCounter() as traffic:
        with meta_autocast(torch.bfloat16):
            loss = model(x_meta).float().square().mean()
        loss.backward()
"""
import contextlib
import threading
import warnings

import torch
from torch._C import DispatchKey

__all__ = ['meta_autocast', 'meta_autocast_enabled', 'meta_autocast_dtype', 'meta_autocast_off',
           'autocast_args', 'meta_autocast_as',
           'LOWER_PRECISION', 'FP32', 'FP32_SET_OPT_DTYPE', 'FP32_APPEND_DTYPE', 'PROMOTE']

#: CUDA's ``lower_precision_fp`` operations (``AT_FORALL_LOWER_PRECISION_FP`` and the cuDNN
#: convolutions), as ``name.overload``
LOWER_PRECISION = (
    '_convolution.deprecated', '_convolution', 'conv1d', 'conv2d', 'conv3d', 'conv_tbc',
    'conv_transpose1d', 'conv_transpose2d.input', 'conv_transpose3d.input', 'convolution', 'prelu',
    'addmm', 'addmv', 'addr', 'matmul', 'einsum', 'mm', 'mv', 'linalg_vecdot', 'linear', 'addbmm',
    'baddbmm', 'bmm', 'chain_matmul', 'linalg_multi_dot', '_thnn_fused_lstm_cell',
    '_thnn_fused_gru_cell', 'lstm_cell', 'gru_cell', 'rnn_tanh_cell', 'rnn_relu_cell',
    '_scaled_dot_product_flash_attention', 'scaled_dot_product_attention', 'cudnn_convolution',
    'cudnn_convolution_transpose', '_cudnn_rnn')
#: CUDA's ``fp32`` operations (``AT_FORALL_FP32``)
FP32 = (
    'acos', 'asin', 'cosh', 'erfinv', 'exp', 'expm1', 'log', 'log10', 'log2', 'log1p',
    'reciprocal', 'rsqrt', 'sinh', 'tan', 'pow.Tensor_Scalar', 'pow.Tensor_Tensor', 'pow.Scalar',
    'softplus', 'layer_norm', 'native_layer_norm', 'rms_norm', 'group_norm', 'frobenius_norm.dim',
    'nuclear_norm', 'nuclear_norm.dim', 'cosine_similarity', 'poisson_nll_loss',
    'cosine_embedding_loss', 'nll_loss', 'nll_loss2d', 'hinge_embedding_loss', 'kl_div',
    'l1_loss', 'smooth_l1_loss', 'huber_loss', 'mse_loss', 'margin_ranking_loss',
    'multilabel_margin_loss', 'soft_margin_loss', 'triplet_margin_loss', 'multi_margin_loss',
    'binary_cross_entropy_with_logits', 'dist', 'pdist', 'cdist', 'renorm', 'logsumexp',
    'upsample_nearest1d', '_upsample_nearest_exact1d', 'upsample_nearest2d',
    '_upsample_nearest_exact2d', 'upsample_nearest3d', '_upsample_nearest_exact3d',
    'upsample_linear1d', 'upsample_bilinear2d', '_upsample_bilinear2d_aa', 'upsample_trilinear3d',
    'upsample_bicubic2d', '_upsample_bicubic2d_aa')
#: CUDA's ``fp32_set_opt_dtype`` operations (``AT_FORALL_FP32_SET_OPT_DTYPE``)
FP32_SET_OPT_DTYPE = (
    'prod', 'prod.dim_int', 'softmax.int', 'log_softmax.int', 'cumprod', 'cumsum',
    'linalg_vector_norm', 'linalg_matrix_norm', 'linalg_matrix_norm.str_ord', 'sum',
    'sum.dim_IntList')
#: CUDA's ``fp32_append_dtype`` operations: overload -> the overload called with dtype float32
FP32_APPEND_DTYPE = {'norm.Scalar': 'norm.ScalarOpt_dtype',
                     'norm.ScalarOpt_dim': 'norm.ScalarOpt_dim_dtype'}
#: CUDA's ``promote`` operations (``AT_FORALL_PROMOTE``)
PROMOTE = ('addcdiv', 'addcmul', 'atan2', 'bilinear', 'cross', 'dot', 'vdot', 'grid_sampler',
           'index_put', 'tensordot', 'scatter_add')

# the key that carries the policy: the autocast key of a device this machine has not, whose own
# kernels leave meta tensors alone
_KEY = DispatchKey.AutocastXPU
_KEYSET = torch._C.DispatchKeySet(_KEY)
_DEVICE = 'xpu'  # its autocast switch

_state = threading.local()


def _get(name, default=None):
    return getattr(_state, name, default)


def meta_autocast_enabled():
    """Whether a :func:`meta_autocast` region is active and not switched off inside."""
    return _get('dtype') is not None and torch.is_autocast_enabled(_DEVICE)


def meta_autocast_dtype():
    """The dtype of the active :func:`meta_autocast` region (None outside one)."""
    return _get('dtype')


def _op(name):
    base, _, overload = name.partition('.')
    return getattr(getattr(torch.ops.aten, base), overload or 'default')


def _eligible(t):
    return (isinstance(t, torch.Tensor) and t.device.type == 'meta' and t.is_floating_point()
            and t.dtype != torch.float64)


def _cast(t, dtype):
    """CUDA's ``cached_cast``: an eligible tensor in ``dtype``; a float32 leaf that needs a
    gradient (a weight) cast to the autocast dtype once per region."""
    if isinstance(t, (list, tuple)):
        return type(t)(_cast(x, dtype) for x in t)
    if not _eligible(t) or t.dtype == dtype:
        return t
    cache = _get('cache')
    if (dtype == _get('dtype') and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
            and not t._is_view() and cache is not None and torch.is_autocast_cache_enabled()
            and not torch.is_inference_mode_enabled()):
        hit = cache.get(id(t))
        if hit is None:  # the source kept with its cast: its id is not reused in the region
            hit = cache[id(t)] = (t, t.to(dtype))
        return hit[1]
    return t.to(dtype)


def autocast_args(*tensors):
    """``tensors`` as a lower-precision operation of the active region casts them (None and
    tensors it leaves alone as they are); all as they are outside a region or with it off."""
    if not meta_autocast_enabled():
        return tensors
    return tuple(_cast(t, _get('dtype')) for t in tensors)


def _redispatch(op, args, kwargs):
    with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
        return op(*args, **kwargs)


def _lower_precision(op):
    def kernel(*args, **kwargs):
        dtype = _get('dtype')
        return _redispatch(op, [_cast(a, dtype) for a in args],
                           {k: _cast(v, dtype) for k, v in kwargs.items()})
    return kernel


def _fp32(op):
    def kernel(*args, **kwargs):
        return _redispatch(op, [_cast(a, torch.float32) for a in args],
                           {k: _cast(v, torch.float32) for k, v in kwargs.items()})
    return kernel


def _fp32_set_opt_dtype(op):
    names = [a.name for a in op._schema.arguments]
    where = names.index('dtype')
    # aten's softmax and log_softmax of a half CUDA tensor with dtype float32 read it as it is
    # (``_softmax(x, dim, half_to_float=True)``); other devices, meta too, cast it first
    half_to_float = {'softmax': torch.ops.aten._softmax.default,
                     'log_softmax': torch.ops.aten._log_softmax.default}.get(op._schema.name[6:])

    def kernel(*args, **kwargs):
        if args and _eligible(args[0]):
            if where < len(args):
                if args[where] is None:
                    args = args[:where] + (torch.float32,) + args[where + 1:]
            elif kwargs.get('dtype') is None:
                kwargs = dict(kwargs, dtype=torch.float32)
            dtype = args[where] if where < len(args) else kwargs['dtype']
            if half_to_float is not None and args[0].dtype == torch.float16 \
                    and dtype == torch.float32:
                return _redispatch(half_to_float, (args[0], args[1], True), {})
        return _redispatch(op, args, kwargs)
    return kernel


def _fp32_append_dtype(op, to):
    schema = op._schema.arguments

    def kernel(*args, **kwargs):
        if args and _eligible(args[0]):
            # the arguments left to their defaults given by name: the overload with a dtype has
            # no defaults for them
            full = dict(kwargs)
            for i, arg in enumerate(schema):
                if i >= len(args) and arg.name not in full and arg.has_default_value():
                    full[arg.name] = arg.default_value
            return _redispatch(to, args, dict(full, dtype=torch.float32))
        return _redispatch(op, args, kwargs)
    return kernel


def _prioritize(current, nxt):
    """CUDA's ``prioritize`` of the promote policy: the widest of the autocast dtype and the
    floating arguments' (float64 arguments left out); half and bfloat16 together are an error,
    as there."""
    if nxt == torch.float64:
        return current
    if torch.float32 in (current, nxt):
        return torch.float32
    if current == nxt:
        return current
    raise RuntimeError(f'meta_autocast: {current} and {nxt} meet in an operation that autocast '
                       'promotes (CUDA\'s autocast refuses it too)')


def _promote(op):
    def kernel(*args, **kwargs):
        flat = [t for a in list(args) + list(kwargs.values())
                for t in (a if isinstance(a, (list, tuple)) else (a,))
                if isinstance(t, torch.Tensor) and t.device.type == 'meta'
                and t.is_floating_point()]
        if not flat:
            return _redispatch(op, args, kwargs)
        widest = _get('dtype')
        for t in flat:
            widest = _prioritize(widest, t.dtype)
        return _redispatch(op, [_cast(a, widest) for a in args],
                           {k: _cast(v, widest) for k, v in kwargs.items()})
    return kernel


def _kernels():
    """OpOverload -> the Python kernel of its policy (ops the installed torch lacks skipped)."""
    table = {}
    for names, make in ((LOWER_PRECISION, _lower_precision), (FP32, _fp32),
                        (FP32_SET_OPT_DTYPE, _fp32_set_opt_dtype), (PROMOTE, _promote)):
        for name in names:
            try:
                op = _op(name)
            except AttributeError:
                continue
            table[op] = make(op)
    for name, to in FP32_APPEND_DTYPE.items():
        table[_op(name)] = _fp32_append_dtype(_op(name), _op(to))
    return table


def _install(kernels):
    """The kernels registered for the key (over its own: restored when the library goes)."""
    lib = torch.library.Library('aten', 'IMPL')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # "overriding a previously registered kernel"
        for op, kernel in kernels.items():
            lib.impl(op, kernel, _KEY.name)
    return lib


@contextlib.contextmanager
def meta_autocast(dtype=torch.bfloat16):
    """A region in which operations on ``meta`` tensors follow CUDA's autocast to ``dtype``
    (``torch.bfloat16`` or ``torch.float16``); tensors on other devices are not affected by it
    (run them under ``torch.autocast``). Not nested in itself. For counting on one thread: the
    kernels are registered for the whole process while the region lasts.

    Raises:
        ValueError: ``dtype`` is not a half-precision floating dtype.
        RuntimeError: a region is already active in this thread.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f'meta_autocast: dtype must be torch.bfloat16 or torch.float16, got '
                         f'{dtype}')
    if _get('dtype') is not None:
        raise RuntimeError('meta_autocast: a region is already active in this thread')
    was_on = torch.is_autocast_enabled(_DEVICE)
    lib = _install(_kernels())
    _state.dtype, _state.cache = dtype, {}
    try:
        with torch._C._IncludeDispatchKeyGuard(_KEY):
            torch.set_autocast_enabled(_DEVICE, True)
            try:
                yield
            finally:
                torch.set_autocast_enabled(_DEVICE, was_on)
    finally:
        _state.dtype, _state.cache = None, None
        lib._destroy()


@contextlib.contextmanager
def meta_autocast_as(dtype):
    """The meta autocast state ``dtype`` (None: off) again, for a recomputation in the backward
    (activation checkpointing restores autocast for the devices it knows, and ``meta`` is not
    one): a :func:`meta_autocast` region of ``dtype`` if none is active, else the active one
    switched on."""
    if dtype is None:
        with meta_autocast_off():
            yield
    elif _get('dtype') is None:
        with meta_autocast(dtype):
            yield
    else:
        with _switched(True):
            yield


@contextlib.contextmanager
def meta_autocast_off():
    """Inside a :func:`meta_autocast` region: meta tensors in their own dtypes again (what
    ``torch.autocast(..., enabled=False)`` does on CUDA)."""
    with _switched(False):
        yield


@contextlib.contextmanager
def _switched(on):
    """The region's autocast switched on or off, and back as it was at the exit."""
    was_on = torch.is_autocast_enabled(_DEVICE)
    torch.set_autocast_enabled(_DEVICE, on)
    try:
        yield
    finally:
        torch.set_autocast_enabled(_DEVICE, was_on)
