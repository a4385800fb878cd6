"""A device-independent peak-memory counter: live tensor storage bytes allocated inside a context.

:class:`PeakMemoryCounter` is a :class:`~torch.utils._python_dispatch.TorchDispatchMode`: every
tensor produced by an ATen op while the mode is active has its storage recorded (bytes, once per
storage; views and in-place results share the storage of their base) and released through a weak
reference when the storage is freed. ``peak_bytes`` is the maximum of the live total seen after any
op. It measures *what the computation keeps alive*, on CPU as on GPU, independently of the caching
allocator, of time and of other processes, which makes it suited to tests of memory complexity
(e.g. "no N×N tensor ever exists").

Counted: storages created inside the context (including autograd-saved tensors and gradients when
``backward`` runs inside it). Not counted: tensors that existed before entering (parameters, the
inputs) and views of them made inside (such as the ``weight.t()`` of every linear layer),
allocator fragmentation, and temporaries internal to one ATen kernel (e.g. the workspace of a
fused kernel) that never surface as op outputs.

Example::

    with PeakMemoryCounter() as mem:
        y = model(x)
        y.sum().backward()
    print(mem.peak_bytes, mem.live_bytes)
"""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ['PeakMemoryCounter']


class PeakMemoryCounter(TorchDispatchMode):
    """Track live and peak bytes of tensor storages allocated while the mode is active.

    Args:
        include_meta (bool): count ``meta`` tensors too (shapes only, nothing allocated: the
            bytes the same computation keeps alive on a device, e.g. a model's GPU path measured
            without a GPU). Default False: meta tensors are not counted.

    Attributes:
        live_bytes (int): bytes of storages created in the context that are still alive.
        peak_bytes (int): the largest ``live_bytes`` observed after any op.
        num_allocations (int): number of distinct storages recorded.
    """

    def __init__(self, include_meta=False):
        super().__init__()
        self.include_meta = include_meta
        self.live_bytes = 0
        self.peak_bytes = 0
        self.num_allocations = 0
        self._refs = {}  # id(storage) -> (weakref, nbytes)

    def reset_peak(self):
        """Set ``peak_bytes`` to the current ``live_bytes``."""
        self.peak_bytes = self.live_bytes

    def _release(self, key):
        entry = self._refs.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[1]

    def _storage(self, t):
        if not isinstance(t, torch.Tensor) or (t.device.type == 'meta' and not self.include_meta):
            return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. sparse or wrapper tensors
            return None

    def _track(self, t, input_storages):
        st = self._storage(t)
        if st is None:
            return
        key = id(st)
        if key in self._refs or key in input_storages:
            # already counted, or a view / in-place result of a tensor from before the context
            return
        nbytes = st.nbytes()
        self._refs[key] = (weakref.ref(st, lambda _, k=key: self._release(k)), nbytes)
        self.live_bytes += nbytes
        self.num_allocations += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {id(st) for st in map(self._storage, tree_flatten((args, kwargs))[0])
                  if st is not None}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            self._track(t, inputs)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        return out
