"""Keep large CPU tensors on the heap (glibc): a setting for high-resolution CPU inference.

glibc's ``malloc`` serves every request above its mmap threshold (at most 32 MiB, adjusted
upwards after frees) with a fresh ``mmap``, and returns the pages with ``munmap`` when the tensor
is freed. At detection resolution and above, the stage-1 activations of a backbone are tens of MB
each (2048x2048: 262 k tokens x 64 channels x 4 B = 67 MB), so every layer maps fresh pages and
page-faults them in on first touch: the time goes into the kernel (``sys`` time), and an O(N)
backbone looks super-linear (time(2048²)/time(1024²) of 5.5-6 instead of 4).

:func:`use_heap_allocator` switches ``mmap`` off for ``malloc`` (``M_MMAP_MAX = 0``) and keeps
freed memory in the process (``M_TRIM_THRESHOLD``, ``M_TOP_PAD``), so the next layer reuses
pages that are already mapped. It changes the allocator of the whole process, for the allocations
made after the call; the process keeps its peak heap size until it exits. Opt-in (call it once at
the start of an inference or benchmark script); it does nothing off glibc.
"""
import ctypes
import ctypes.util
import platform

__all__ = ['use_heap_allocator']

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_INT_MAX = 2**31 - 1


def _libc():
    if platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc':
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
    except OSError:
        return None


def use_heap_allocator(top_pad_mb=512):
    """Serve large CPU allocations from the heap instead of fresh ``mmap`` s (glibc only).

    Args:
        top_pad_mb (int): extra memory (MiB) requested from the kernel each time the heap grows,
            so that growing by one more activation does not need a system call. Default 512.

    Returns:
        bool: True when applied; False off glibc (nothing changed).
    """
    if top_pad_mb < 0:
        raise ValueError(f'use_heap_allocator: top_pad_mb must be >= 0, got {top_pad_mb}')
    libc = _libc()
    if libc is None or not hasattr(libc, 'mallopt'):
        return False
    pad = min(int(top_pad_mb) * 2**20, _INT_MAX)
    return all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX), (_M_TOP_PAD, pad)))
