"""Utilities shared by tests and benchmarks (no model code)."""
from .malloc import use_heap_allocator
from .memory import PeakMemoryCounter

__all__ = ['PeakMemoryCounter', 'use_heap_allocator']
