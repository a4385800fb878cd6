"""Utilities shared by tests and benchmarks (no model code)."""
from .memory import PeakMemoryCounter

__all__ = ['PeakMemoryCounter']
