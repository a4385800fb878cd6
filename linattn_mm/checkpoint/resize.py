"""Size-dependent tensors of a checkpoint resized to a model: the shared helpers.

A checkpoint tensor whose shape differs from the model's goes to the module that owns it: the
loader calls that module's ``resize_checkpoint_tensor(name, src)`` (see
:func:`resize_with_owner`). The model families implement that method next to their parameters and
use the helpers below for the common layouts:

* :func:`resize_grid_tokens` / :func:`resize_pos_embed`: tables laid out on a square token grid,
  ``(1, E + h*w, C)`` with E extra (class / distillation) rows, or ``(1, C, H, W)``;
* :func:`resize_relative_position_table`: Swin relative position bias tables, per head.

Each helper returns ``(tensor of the model's shape, note for the load report)`` and raises
:class:`CheckpointError` naming the key when the conversion is impossible.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .errors import CheckpointError

__all__ = ['resize_with_owner', 'owner_of', 'resize_grid_tokens', 'resize_pos_embed',
           'resize_relative_position_table', 'split_grid_tokens']


def resize_with_owner(model: torch.nn.Module, key: str, src: torch.Tensor,
                      dst_shape) -> Optional[Tuple[torch.Tensor, str]]:
    """Resize checkpoint tensor ``key`` through the module of ``model`` that owns it.

    The owner is ``model.get_submodule(prefix)`` for ``key = prefix + '.' + name``; its method
    ``resize_checkpoint_tensor(name, src)`` returns ``(tensor, note)`` (a bare tensor is accepted
    too), or ``None`` when it does not resize ``name``. The result must have ``dst_shape``.

    Returns:
        ``(tensor, note)``, or ``None`` when the owner has no such method or declines.

    Raises:
        CheckpointError: the method raised it (re-raised naming the full key), or returned a tensor
            of another shape.
    """
    dst_shape = torch.Size(dst_shape)
    owner, name = owner_of(model, key)
    method = getattr(owner, 'resize_checkpoint_tensor', None)
    if not callable(method):
        return None
    where = f'{type(owner).__name__}.resize_checkpoint_tensor'
    try:
        out = method(name, src)
    except CheckpointError as exc:
        raise CheckpointError(f"cannot resize '{key}' {tuple(src.shape)} -> {tuple(dst_shape)} "
                              f'({where}): {exc}') from None
    if out is None:
        return None
    note = ''
    if isinstance(out, tuple):
        out, note = out
    if not isinstance(out, torch.Tensor) or out.shape != dst_shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise CheckpointError(f"{where} returned {got} for '{key}', expected {tuple(dst_shape)}")
    return out, note or ''


def owner_of(model: torch.nn.Module, key: str) -> Tuple[Optional[torch.nn.Module], str]:
    """``(module of model holding key, key's name in that module)``; ``(None, name)`` when the
    prefix names no submodule."""
    prefix, _, name = key.rpartition('.')
    try:
        return (model.get_submodule(prefix) if prefix else model), name
    except AttributeError:
        return None, name


def _interp(grid: torch.Tensor, size: Tuple[int, int], mode: str = 'bicubic') -> torch.Tensor:
    """``mode`` (bicubic or bilinear, align_corners=False) resize of a (N, C, H, W) tensor,
    computed in float32 for half types."""
    if tuple(grid.shape[-2:]) == tuple(size):
        return grid
    dtype = grid.dtype
    work = grid.float() if dtype in (torch.float16, torch.bfloat16) or not dtype.is_floating_point \
        else grid
    return F.interpolate(work, size=size, mode=mode, align_corners=False).to(dtype)


def split_grid_tokens(key: str, length: int, max_extra: int, what: str) -> Tuple[int, int]:
    """Split a token count into ``(extra tokens, grid side)``: length = extra + side**2."""
    side = math.isqrt(length)
    extra = length - side * side
    if side == 0 or extra > max_extra:
        raise CheckpointError(
            f"'{key}': {what} length {length} is not a square grid"
            + (f' plus at most {max_extra} extra (class) tokens' if max_extra else ''))
    return extra, side


def _source_grid(key: str, src: torch.Tensor, max_extra: int):
    """Checkpoint table -> (extra rows (E, C), grid (1, C, H, W))."""
    if src.dim() == 4:
        if src.shape[0] != 1:
            raise CheckpointError(f"'{key}': expected batch dim 1, got {tuple(src.shape)}")
        return src.new_zeros((0, src.shape[1])), src
    if src.dim() not in (2, 3):
        raise CheckpointError(f"'{key}': unsupported position-embedding shape {tuple(src.shape)}")
    tokens = src
    if src.dim() == 3:
        if src.shape[0] != 1:
            raise CheckpointError(f"'{key}': expected batch dim 1, got {tuple(src.shape)}")
        tokens = src[0]
    channels = tokens.shape[1]
    n_extra, side = split_grid_tokens(key, tokens.shape[0], max_extra, 'checkpoint')
    grid = tokens[n_extra:].reshape(side, side, channels).permute(2, 0, 1).unsqueeze(0)
    return tokens[:n_extra], grid


def resize_grid_tokens(key: str, src: torch.Tensor, dst_shape, max_extra: int,
                       mode: str = 'bicubic') -> Tuple[torch.Tensor, str]:
    """A table on a square token grid resized to ``dst_shape``: ``(1, E + h*w, C)`` (or without
    the batch dim) with at most ``max_extra`` extra rows, or ``(1, C, H, W)``.

    The grid is resized bicubically (``mode``: or bilinearly, as the model's forward resizes it;
    align_corners=False, in float32 for half types); the first
    ``min(E_src, E_dst)`` extra rows are kept, surplus checkpoint rows are dropped and missing ones
    zero-initialised (both said in the note).
    """
    dst_shape = torch.Size(dst_shape)
    notes = []
    extra_src, grid = _source_grid(key, src, max_extra)
    channels = grid.shape[1]
    if len(dst_shape) == 4:
        if dst_shape[0] != 1:
            raise CheckpointError(f"'{key}': model shape {tuple(dst_shape)} has batch dim != 1")
        dst_channels, size, n_extra_dst = dst_shape[1], (dst_shape[2], dst_shape[3]), 0
    elif len(dst_shape) in (2, 3):
        if len(dst_shape) == 3 and dst_shape[0] != 1:
            raise CheckpointError(f"'{key}': model shape {tuple(dst_shape)} has batch dim != 1")
        dst_channels = dst_shape[-1]
        n_extra_dst, side_dst = split_grid_tokens(key, dst_shape[-2], max_extra, 'model')
        size = (side_dst, side_dst)
    else:
        raise CheckpointError(f"'{key}': unsupported model shape {tuple(dst_shape)}")
    if dst_channels != channels:
        raise CheckpointError(
            f"'{key}': embedding dim differs (checkpoint {tuple(src.shape)}, model "
            f'{tuple(dst_shape)}); cannot be resized')
    if tuple(grid.shape[-2:]) != tuple(size):
        notes.append(f'grid {grid.shape[-2]}x{grid.shape[-1]} -> {size[0]}x{size[1]} ({mode})')
    grid = _interp(grid, size, mode)
    n_src = extra_src.shape[0]
    extra = extra_src[:min(n_src, n_extra_dst)]
    if n_src > n_extra_dst:
        notes.append(f'dropped {n_src - n_extra_dst} extra token row(s) (class/dist token)')
    elif n_extra_dst > n_src:
        extra = torch.cat([extra, extra_src.new_zeros((n_extra_dst - n_src, channels))], 0)
        notes.append(f'added {n_extra_dst - n_src} zero-initialised extra token row(s)')
    if len(dst_shape) == 4:
        out = grid
    else:
        out = torch.cat([extra, grid[0].permute(1, 2, 0).reshape(-1, channels)], 0)
        out = out.reshape(dst_shape)
    return out.contiguous(), '; '.join(notes)


def resize_pos_embed(key: str, src: torch.Tensor, dst_shape,
                     mode: str = 'bicubic') -> Tuple[torch.Tensor, str]:
    """Absolute position embeddings ``(1, E + h*w, C)`` (E in {0, 1, 2} class/dist tokens) or
    ``(1, C, H, W)``: :func:`resize_grid_tokens` with up to two extra rows."""
    return resize_grid_tokens(key, src, dst_shape, max_extra=2, mode=mode)


def resize_relative_position_table(key: str, src: torch.Tensor,
                                   dst_shape) -> Tuple[torch.Tensor, str]:
    """Swin relative position bias tables ``((2W-1)**2, nH)``: each head's ``(2W-1)x(2W-1)`` table
    is resized bicubically (align_corners=False). A head-count mismatch is an error."""
    dst_shape = torch.Size(dst_shape)
    if src.dim() != 2 or len(dst_shape) != 2:
        raise CheckpointError(
            f"'{key}': expected 2-D tables, got checkpoint {tuple(src.shape)} / model "
            f'{tuple(dst_shape)}')
    if src.shape[1] != dst_shape[1]:
        raise CheckpointError(
            f"'{key}': number of heads differs (checkpoint {tuple(src.shape)} has {src.shape[1]}, "
            f'model {tuple(dst_shape)} has {dst_shape[1]}); cannot be resized')
    s1, s2 = math.isqrt(src.shape[0]), math.isqrt(dst_shape[0])
    if s1 * s1 != src.shape[0] or s2 * s2 != dst_shape[0]:
        raise CheckpointError(
            f"'{key}': table lengths {src.shape[0]} / {dst_shape[0]} are not squares")
    heads = src.shape[1]
    grid = src.permute(1, 0).reshape(1, heads, s1, s1)
    out = _interp(grid, (s2, s2)).reshape(heads, s2 * s2).permute(1, 0).contiguous()
    return out, f'table {s1}x{s1} -> {s2}x{s2} per head (bicubic)'
