"""Building blocks shared by the skeletons (pure torch)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from linattn_mm.models.attentions.base import build_attention
from linattn_mm.ops.common import promote_types
from linattn_mm.ops.dispatch import check_core
from linattn_mm.ops.ffn import ffn_branch
from linattn_mm.ops.lean_layers import recomputed, scaled_add
# re-exported for the skeletons
from .grid import nchw_to_nlc, nlc_to_nchw, resize_grid_embed  # noqa: F401


_NORM_LAYERS = {'BN': nn.BatchNorm2d, 'BN2d': nn.BatchNorm2d, 'SyncBN': nn.SyncBatchNorm}


def build_bn(norm_cfg, num_features):
    """BatchNorm of ``norm_cfg`` (``type`` in ``BN``/``BN2d``/``SyncBN``, other keys passed on,
    e.g. ``momentum``, ``eps``, ``requires_grad``)."""
    cfg = dict(norm_cfg)
    kind = cfg.pop('type', 'BN')
    requires_grad = cfg.pop('requires_grad', True)
    if kind not in _NORM_LAYERS:
        raise KeyError(f'norm_cfg type must be one of {sorted(_NORM_LAYERS)}, got {kind!r}')
    layer = _NORM_LAYERS[kind](num_features, **cfg)
    for p in layer.parameters():
        p.requires_grad = requires_grad
    return layer


class DropPath(nn.Module):
    """Stochastic depth per sample."""

    def __init__(self, drop_prob=0.):
        super().__init__()
        self.drop_prob = float(drop_prob)

    def forward(self, x):
        if self.drop_prob == 0. or not self.training:
            return x
        keep = 1 - self.drop_prob
        return x * self._mask(x, keep).div_(keep)  # one pass over x, forward and backward

    @staticmethod
    def _mask(t, keep):
        """A per-sample Bernoulli(keep) mask (B, 1, ..., 1) for ``t``, in its dtype."""
        return t.new_empty((t.shape[0], ) + (1, ) * (t.dim() - 1)).bernoulli_(keep)

    def add(self, x, branch, scale=None, fused=False):
        """``x + self(branch)``, the residual sum of a dropped branch (with ``scale``, a layer
        scale that broadcasts over the branch such as (1, C, 1, 1): ``x + self(scale * branch)``),
        as one operation over the maps each way: the per-sample mask (drawn as in
        :meth:`forward`, the same random numbers), its ``1 / keep`` and the scale make one small
        factor ``f``, and :func:`~linattn_mm.ops.lean_layers.scaled_add` adds ``branch * f`` to
        ``x`` in one pass, its backward writing the branch's gradient in one more (plain autograd
        of the product and the sum makes two or three full-size maps each way, and under autocast
        a float32 copy of a half-precision branch). The same values and dtype up to the rounding
        of ``1 / keep`` (now in float32 at least) and the order of the products. ``fused``
        (NaLaFormer blocks on ``ffn_core='fused'``; CUDA): the backward of the sum of NCHW maps as
        one Triton kernel (:func:`linattn_mm.ops.ffn.fused.scaled_add_fused`)."""
        add = scaled_add
        if fused:
            from linattn_mm.ops.ffn.fused import scaled_add_fused as add
        dropped = self.drop_prob != 0. and self.training
        if not dropped:
            return x + branch if scale is None else add(x, branch, scale)
        keep = 1 - self.drop_prob
        f = self._mask(branch, keep)  # 1 / keep in float32 at least, not in a half precision
        f = f.to(promote_types(f.dtype, torch.float32)).div_(keep)
        # the dtype of x + mask * (scale * branch): the float32 factor does not promote the sum
        out = promote_types(x.dtype, branch.dtype if scale is None else
                            promote_types(scale.dtype, branch.dtype))
        return add(x, branch, f if scale is None else scale * f, out)

    def extra_repr(self):
        return f'drop_prob={self.drop_prob}'


class DWConv(nn.Module):
    """3×3 depth-wise conv on tokens (PVTv2 FFN). Key: ``dwconv.weight``."""

    def __init__(self, dims):
        super().__init__()
        self.dwconv = nn.Conv2d(dims, dims, 3, 1, 1, bias=True, groups=dims)

    def forward(self, x, hw_shape):
        return nchw_to_nlc(self.dwconv(nlc_to_nchw(x, hw_shape)))


class Mlp(nn.Module):
    """Transformer FFN ``fc2(act(fc1(x)))``; with ``dwconv=True`` a 3×3 depth-wise conv follows fc1
    (PVTv2). Keys ``fc1``, ``fc2`` (and ``dwconv.dwconv``) as in the official code."""

    def __init__(self, in_dims, hidden_dims, drop=0., dwconv=False):
        super().__init__()
        self.fc1 = nn.Linear(in_dims, hidden_dims)
        self.dwconv = DWConv(hidden_dims) if dwconv else None
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dims, in_dims)
        self.drop = nn.Dropout(drop)

    def forward(self, x, hw_shape):
        x = self.fc1(x)
        if self.dwconv is not None:
            x = self.dwconv(x, hw_shape)
        return self.drop(self.fc2(self.drop(self.act(x))))


class TransformerBlock(nn.Module):
    """Pre-norm block ``x + attn(norm1(x)); x + mlp(norm2(x))`` with any token mixer.

    Args:
        embed_dims (int): channels.
        num_heads (int): heads.
        attn_cfg (dict): token-mixer config (see :func:`build_attention`).
        mlp_ratio (float): FFN hidden ratio.
        drop_path (float): stochastic depth rate of this block.
        drop_rate (float): dropout in FFN/projection.
        dwconv_mlp (bool): PVTv2 FFN.
        with_cp (bool): gradient checkpointing of this block.
        norm_eps (float): LayerNorm epsilon (official PVT/DeiT: 1e-6, Swin: 1e-5).
        context (dict): extra context for the token mixer (block_idx, pretrain_hw, ...).

    The FFN half runs as :func:`linattn_mm.ops.ffn.ffn_branch` (``ffn_core='fast'``, chosen at
    construction for the LayerNorm + Linear-GELU-Linear FFN without dropout): the same values and
    gradients, with only the block input, its LayerNorm statistics and the ``fc1`` output kept for
    backward. ``ffn_core='reference'`` (the PVTv2 depth-wise FFN, dropout, or set by hand) runs
    the modules one by one.
    """

    def __init__(self, embed_dims, num_heads, attn_cfg, mlp_ratio=4., drop_path=0., drop_rate=0.,
                 dwconv_mlp=False, with_cp=False, norm_eps=1e-6, **context):
        super().__init__()
        if dwconv_mlp and context.get('num_extra_tokens'):
            raise ValueError('a depth-wise conv FFN cannot take class tokens')
        self.norm1 = nn.LayerNorm(embed_dims, eps=norm_eps)
        self.attn = build_attention(attn_cfg, embed_dims=embed_dims, num_heads=num_heads,
                                    proj_drop=drop_rate, **context)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(embed_dims, eps=norm_eps)
        self.mlp = Mlp(embed_dims, int(embed_dims * mlp_ratio), drop_rate, dwconv_mlp)
        self.with_cp = with_cp
        lean = (not dwconv_mlp and drop_rate == 0 and type(self.mlp.act) is nn.GELU)
        self.ffn_core = check_core(type(self).__name__, 'fast' if lean else 'reference',
                                   ('fast', 'reference'))

    def ffn(self, x, hw_shape):
        """The FFN branch ``mlp(norm2(x))`` (see ``ffn_core``)."""
        if self.ffn_core == 'fast':
            return ffn_branch(x, self.norm2, self.mlp)
        return self.mlp(self.norm2(x), hw_shape)

    def _forward(self, x, hw_shape):
        x = self.drop_path.add(x, self.attn(self.norm1(x), hw_shape))
        return self.drop_path.add(x, self.ffn(x, hw_shape))

    def forward(self, x, hw_shape):
        if self.with_cp and x.requires_grad:
            return recomputed(self._forward, x, hw_shape)
        return self._forward(x, hw_shape)


class PatchEmbed(nn.Module):
    """Conv patch embedding + optional LayerNorm; keys ``proj`` and ``norm``.

    Non-overlapping embeddings (kernel == stride) pad the input at the bottom/right to a multiple of
    the stride, so the output grid is ``ceil(H / stride) × ceil(W / stride)`` for any input; overlapping
    ones (PVTv2: kernel 7 stride 4 pad 3, kernel 3 stride 2 pad 1) give the same grid through padding.
    """

    def __init__(self, in_channels, embed_dims, kernel_size, stride, padding=0, norm=True,
                 norm_eps=1e-5):
        super().__init__()
        self.stride = stride
        self.kernel_size = kernel_size
        self.proj = nn.Conv2d(in_channels, embed_dims, kernel_size, stride, padding)
        self.norm = nn.LayerNorm(embed_dims, eps=norm_eps) if norm else None

    def forward(self, x):
        """(B, C, H, W) -> tokens (B, N, C'), hw_shape."""
        x = self.pad(x)
        x = self.proj(x)
        hw = tuple(x.shape[-2:])
        x = nchw_to_nlc(x)
        if self.norm is not None:
            x = self.norm(x)
        return x, hw

    def pad(self, x):
        """Non-overlapping embeddings: the input padded at the bottom / right to a multiple of the
        stride."""
        if self.kernel_size != self.stride:
            return x
        H, W = x.shape[-2:]
        pad_b, pad_r = (-H) % self.stride, (-W) % self.stride
        return F.pad(x, (0, pad_r, 0, pad_b)) if pad_b or pad_r else x


class PatchMerging(nn.Module):
    """Swin 2×2 patch merging (pads odd sizes); keys ``norm`` (4C) and ``reduction`` (4C -> out)."""

    def __init__(self, in_dims, out_dims):
        super().__init__()
        self.norm = nn.LayerNorm(4 * in_dims)
        self.reduction = nn.Linear(4 * in_dims, out_dims, bias=False)

    def forward(self, x, hw_shape):
        B, N, C = x.shape
        H, W = hw_shape
        x = x.view(B, H, W, C)
        if H % 2 or W % 2:
            x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        hw = tuple(x.shape[1:3])
        return self.reduction(self.norm(x.view(B, -1, 4 * C))), hw


def square_hw(num_tokens):
    side = int(round(math.sqrt(num_tokens)))
    if side * side != num_tokens:
        raise ValueError(f'{num_tokens} tokens do not form a square grid')
    return side, side


def make_blocks(depth, dpr, **kwargs):
    """A ModuleList of ``depth`` TransformerBlocks with stochastic-depth rates ``dpr``."""
    return nn.ModuleList(
        [TransformerBlock(drop_path=dpr[j], block_idx=j, **kwargs) for j in range(depth)])


class BlocksThenDownsample(nn.Module):
    """A hierarchical stage: ``self.blocks`` (token blocks taking ``(x, hw_shape)``) then an
    optional ``self.downsample`` (``(x, hw) -> (x', hw')``). ``forward`` returns the stage output
    with its grid and the next stage's input with its grid: ``(out, out_hw, next, next_hw)``."""

    def forward(self, x, hw_shape):
        for blk in self.blocks:
            x = blk(x, hw_shape)
        if self.downsample is None:
            return x, hw_shape, x, hw_shape
        down, down_hw = self.downsample(x, hw_shape)
        return x, hw_shape, down, down_hw
