"""A count of the ATen operations a computation issues.

On a GPU each operation is at least one launch prepared by the host (the dispatcher, autograd's
bookkeeping, the Python that calls it); where the kernels are short (a training step at batch 1)
the host sets the pace, and the number of operations says how long it takes. The count is the
same on every device for the same code path, so it can be taken on CPU: with ``meta`` tensors
(shapes only, nothing computed) a model runs the paths it takes off CPU (one chunk, sums over the
tokens in parts), which is how ``tools/benchmark.py --count-ops --device meta`` counts the
operations of a CUDA training step on a machine without a GPU.

Example::

    with OperationCounter() as ops:
        model(x).sum().backward()
    print(ops.total, ops.by_name.most_common(5))

:class:`TrafficCounter` also adds up the bytes each operation reads and writes and the FLOPs of
its matrix products and convolutions: where the kernels are long (batch 8 under autocast) the
memory traffic and the FLOPs set the pace, and on ``meta`` these too are the GPU path's
(``tools/benchmark.py --device meta`` prints them, with a roofline bound for a named GPU).
"""
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

__all__ = ['OperationCounter', 'OperationsByModule', 'TrafficCounter', 'spanned_bytes']


class OperationCounter(TorchDispatchMode):
    """Counts the ATen operations run while the mode is active (the backward too, when it runs
    inside), views excluded (``view``, ``transpose``, slices: no kernel, no new storage).

    Attributes:
        total (int): operations counted.
        by_name (collections.Counter): operation name (``'mm'``, ``'mul'``, ...) -> count.
    """

    def __init__(self):
        super().__init__()
        self.total = 0
        self.by_name = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.total += 1
            self.by_name[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


# operations whose outputs are not written by a kernel (new storage left uninitialised) or that
# read or write nothing (a scalar read back, autograd's detach)
_NO_TRAFFIC = frozenset(['empty', 'empty_strided', 'empty_like', 'new_empty', 'new_empty_strided',
                         '_local_scalar_dense', 'detach', 'lift_fresh', 'set_', 'resize_',
                         '_unsafe_view', 'alias'])
# operations that write their outputs without reading their tensor arguments' elements
_WRITE_ONLY = frozenset(['zeros', 'zeros_like', 'new_zeros', 'ones', 'ones_like', 'new_ones',
                         'full', 'full_like', 'new_full', 'zero_', 'fill_', 'normal_', 'uniform_',
                         'bernoulli_', 'randn', 'rand', 'randn_like', 'rand_like', 'arange'])


def spanned_bytes(t):
    """Bytes of the elements a tensor addresses: its size, a broadcast (stride 0) dimension
    counted once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


def _tensors(tree):
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _flops(func, args, kwargs, out):
    """Floating-point operations of one call by torch's formulas (matrix products, convolutions,
    fused attention; 0 for the rest). The grouped convolution's backward is counted here: torch's
    formula leaves out its groups (a depth-wise conv's backward came out ``channels`` times too
    large)."""
    name = func.overloadpacket.__name__
    if name == 'convolution_backward':
        grad_out, inp, weight, transposed, mask = args[0], args[1], args[2], args[7], args[-1]
        # the forward's FLOPs per gradient asked for: 2 * outputs * (in-channels per group *
        # kernel), or for a transposed convolution 2 * inputs * (out-channels per group * kernel)
        per_grad = 2 * (inp if transposed else grad_out).numel() * weight[0].numel()
        return per_grad * (int(bool(mask[0])) + int(bool(mask[1])))
    formula = flop_registry.get(func.overloadpacket)
    return 0 if formula is None else int(formula(*args, **(kwargs or {}), out_val=out))


#: operations whose FLOPs run at the rate of another dtype than their first tensor's (operator
#: overload packet -> dtype), see :func:`register_compute_dtype`
_COMPUTE_DTYPES = {}


def register_compute_dtype(op, dtype):
    """Count the FLOPs of ``op`` (an operator overload packet, e.g. ``torch.ops.ns.name``) at the
    rate of ``dtype`` in :meth:`TrafficCounter.roofline_seconds`, whatever its tensors' dtypes:
    the Triton cores' launches read half-precision q, k, v under autocast and compute their
    products in float32."""
    _COMPUTE_DTYPES[op] = dtype


class TrafficCounter(OperationCounter):
    """An :class:`OperationCounter` that also adds up what each operation moves and computes:
    ``bytes_moved`` (the elements its tensor arguments address plus those of its outputs, each
    once: the memory traffic of a kernel that reads its inputs and writes its outputs once, a
    lower bound) and ``flops`` (matrix products, convolutions and fused attention by
    ``torch.utils.flop_counter``'s formulas). On ``meta`` tensors these are the figures of the
    GPU path, with nothing computed.

    :meth:`roofline_seconds` turns them into a lower bound of a device's time: every operation at
    least its bytes over the memory bandwidth and its FLOPs over the peak rate of its dtype.

    Attributes:
        bytes_moved (int): summed over the operations (views and new uninitialised buffers: 0).
        flops (int): summed over the operations.
        records (list[tuple[str, int, int, torch.dtype]]): per operation: name, bytes, FLOPs,
            the dtype its FLOPs run at (that of its first tensor argument, or the one
            :func:`register_compute_dtype` gave the operation).
    """

    def __init__(self):
        super().__init__()
        self.bytes_moved = 0
        self.flops = 0
        self.records = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func.is_view:
            return out
        name = func.overloadpacket.__name__
        ins = _tensors((args, {k: v for k, v in kwargs.items() if k != 'out'}))
        outs = _tensors(out)
        if name in _NO_TRAFFIC:
            nbytes = 0
        elif name == 'copy_':  # the destination is written, not read
            nbytes = spanned_bytes(args[1]) + spanned_bytes(args[0])
        elif name in _WRITE_ONLY:
            nbytes = sum(spanned_bytes(t) for t in outs)
        else:
            nbytes = sum(spanned_bytes(t) for t in ins) + sum(spanned_bytes(t) for t in outs)
        flops = _flops(func, args, kwargs, out)
        self.bytes_moved += nbytes
        self.flops += flops
        dtype = _COMPUTE_DTYPES.get(func.overloadpacket, ins[0].dtype if ins else None)
        self.records.append((name, nbytes, flops, dtype))
        return out

    def roofline_seconds(self, bandwidth, peak_flops):
        """Lower bound of the time on a device: the sum over operations of
        ``max(bytes / bandwidth, flops / peak_flops[dtype])``.

        Args:
            bandwidth (float): memory bandwidth, bytes per second.
            peak_flops (dict): dtype -> FLOPs per second (``torch.float32`` required: the rate of
                dtypes not listed).
        """
        total = 0.
        for _, nbytes, flops, dtype in self.records:
            rate = peak_flops.get(dtype, peak_flops[torch.float32])
            total += max(nbytes / bandwidth, flops / rate)
        return total


#: the key (with the counter's id) under which :class:`OperationsByModule` writes a node's module
#: into its metadata
_MODULE_KEY = 'linattn_mm_module'


class OperationsByModule(TrafficCounter):
    """A :class:`TrafficCounter` that also tells which module each operation came from: forward
    operations are counted for the innermost module running (its class name), and backward ones
    for the module whose forward made the autograd node that runs them; ``'(outside)'`` where
    there is none (the loss and its gradient).

    A module's nodes are those reached from the tensors it returns (in tuples, lists or dicts)
    that its forward made; the nodes of tensors it hands on otherwise (in another object, or kept
    as an attribute) count for the module whose outputs reach them. A recomputation in the
    backward (activation checkpointing) counts for the module whose node asked for it (the
    recomputed region's last); the nodes it makes are not marked, and where they run (a reentrant
    checkpoint's) they count as ``'(outside)'``. A module whose forward raises is left there:
    what runs next counts for the modules around it.

    Example::

        with OperationsByModule(model) as ops:
            model(x).sum().backward()
        for (module, phase), (count, nbytes) in ops.by_module.most_common(5): ...

    Attributes:
        by_module (collections.Counter): ``(module class name, 'forward' | 'backward')`` ->
            ``[operations, bytes moved]`` (a two-item list; ``most_common`` orders by it).
    """
    OUTSIDE = '(outside)'

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.by_module = collections.Counter()
        self._stack = []
        self._handles = []
        self._key = f'{_MODULE_KEY}_{id(self)}'  # counters nested on parts of one model

    def __enter__(self):
        for module in self.model.modules():
            self._handles.append(module.register_forward_pre_hook(self._enter_module))
            # also when the forward raises (a checkpoint stops its recomputation so)
            self._handles.append(module.register_forward_hook(self._leave_module,
                                                              always_call=True))
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()
        return super().__exit__(*exc)

    def _enter_module(self, module, args):
        # autograd nodes made from here on (in the forward, on this thread) get sequence numbers
        # from this one on
        self._stack.append((module, torch._C._autograd._get_sequence_nr()))

    def _leave_module(self, module, args, output):
        while self._stack:  # down to this module's entry (one left by a raise: gone with it)
            entry, first = self._stack.pop()
            if entry is module:
                break
        else:
            return
        if torch._C._current_autograd_node() is not None:
            return  # a recomputation in the backward (sequence numbers of another thread)
        # the nodes this forward made (its own operations'; those of inner modules are marked
        # already): every node reached from the outputs with a sequence number from ``first`` on
        name = type(module).__name__
        todo = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        seen = set()
        while todo:
            node = todo.pop()
            if node is None or node in seen or node._sequence_nr() < first:
                continue
            seen.add(node)
            node.metadata.setdefault(self._key, name)
            todo.extend(n for n, _ in node.next_functions)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.bytes_moved
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if not func.is_view:
            node = torch._C._current_autograd_node()
            if node is not None:
                key = (node.metadata.get(self._key, self.OUTSIDE), 'backward')
            else:
                key = (type(self._stack[-1][0]).__name__ if self._stack else self.OUTSIDE,
                       'forward')
            entry = self.by_module.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += self.bytes_moved - before
        return out
