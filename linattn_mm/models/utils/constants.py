"""Shape-only tables made once per key: :func:`~linattn_mm.ops.constants.shape_constant` (it
lives with the kernels, which use it too; this module keeps the models' import path)."""
from ...ops.constants import clear_shape_constants, shape_constant

__all__ = ['shape_constant', 'clear_shape_constants']
