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
"""
import collections

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ['OperationCounter']


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
