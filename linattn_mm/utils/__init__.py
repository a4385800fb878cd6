"""Utilities shared by tests, benchmarks and the kernels of :mod:`linattn_mm.ops` (no model
code)."""
from .malloc import use_heap_allocator
from .memory import PeakMemoryCounter
from .autocast_meta import meta_autocast
from .op_counter import OperationCounter, OperationsByModule, TrafficCounter

__all__ = ['OperationCounter', 'OperationsByModule', 'PeakMemoryCounter', 'TrafficCounter',
           'meta_autocast', 'use_heap_allocator']
