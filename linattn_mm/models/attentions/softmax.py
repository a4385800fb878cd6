"""Softmax attention references: global multi-head attention, Swin window attention and PVT
spatial-reduction attention. Parameter names follow the official DeiT / Swin / PVT code, so
official checkpoints load with their keys unchanged."""
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from linattn_mm.ops.lean_layers import GatherTokens
from linattn_mm.registry import ATTENTIONS
from .base import BaseTokenMixer, merge_heads, split_heads
from ..utils.constants import shape_constant
from ..utils.grid import nlc_to_nchw


@ATTENTIONS.register_module()
class GlobalSoftmaxAttention(BaseTokenMixer):
    """Global multi-head self-attention (ViT/DeiT) via ``F.scaled_dot_product_attention``.

    Args:
        embed_dims (int): channels.
        num_heads (int): heads.
        num_extra_tokens (int): class tokens before the grid; they attend and are attended like any
            token.
        qkv_bias (bool): bias in the qkv projection. Default True.
        qk_scale (float, optional): logit scale; default ``head_dims ** -0.5``.
        attn_drop (float): dropout on attention weights (training only).
        proj_drop (float): dropout after the output projection.
    """

    def __init__(self, embed_dims, num_heads, num_extra_tokens=0, qkv_bias=True, qk_scale=None,
                 attn_drop=0., proj_drop=0., init_cfg=None):
        super().__init__(embed_dims, num_heads, num_extra_tokens, init_cfg)
        self.scale = qk_scale or self.head_dims ** -0.5
        self.qkv = nn.Linear(embed_dims, embed_dims * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x, hw_shape):
        self.check_input(x, hw_shape)
        q, k, v = split_heads(self.qkv(x), self.num_heads * 3).chunk(3, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_drop if self.training else 0., scale=self.scale)
        return self.proj_drop(self.proj(merge_heads(out)))

    has_attention_weights = True

    def attention_weights(self, x, hw_shape):
        self.check_input(x, hw_shape)
        q, k, _ = split_heads(self.qkv(x), self.num_heads * 3).chunk(3, dim=1)
        return dict(weights=(q @ k.transpose(-2, -1) * self.scale).softmax(-1),
                    key_hw=tuple(hw_shape))


def relative_position_index(window_size):
    """Index (Wh*Ww, Wh*Ww) into a ((2Wh-1)*(2Ww-1), h) bias table, as in Swin."""
    wh, ww = window_size
    coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing='ij')).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)
    rel[:, :, 0] += wh - 1
    rel[:, :, 1] += ww - 1
    rel[:, :, 0] *= 2 * ww - 1
    return rel.sum(-1)


def window_partition(x, ws):
    """(B, H, W, C) with H, W multiples of ws -> (B*nW, ws*ws, C)."""
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, ws * ws, C)


def window_reverse(windows, ws, H, W):
    """Inverse of :func:`window_partition`."""
    C = windows.shape[-1]
    B = windows.shape[0] // ((H // ws) * (W // ws))
    x = windows.view(B, H // ws, W // ws, ws, ws, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, H, W, C)


@shape_constant(maxsize=64)
def window_layout(H, W, ws, shift, device):
    """Where the tokens of an H x W grid go in Swin's windows: the grid padded at the bottom /
    right to multiples of ``ws``, cyclically shifted by ``shift`` (``torch.roll`` by ``-shift``)
    and split into ws x ws windows. Returns ``(idx, holes, inv, inv_holes)``: ``idx`` (Hp*Wp, )
    the token of every window position (window by window, -1 on the padding), ``holes`` the
    padding's positions, ``inv`` (H*W, ) the window position of every token, ``inv_holes`` empty
    (for :class:`~linattn_mm.ops.lean_layers.GatherTokens`, both ways). Made once per arguments
    (:func:`~linattn_mm.models.utils.constants.shape_constant`): not to be modified. Every shape
    is known from the arguments (the positions are sorted, not selected by ``nonzero``), so the
    layout is made on ``meta`` too and traced by ``torch.compile`` without a break."""
    Hp, Wp = H + (-H) % ws, W + (-W) % ws
    ys = (torch.arange(Hp, device=device) + shift) % Hp
    xs = (torch.arange(Wp, device=device) + shift) % Wp
    grid = ys[:, None] * W + xs[None, :]
    grid = grid.masked_fill((ys[:, None] >= H) | (xs[None, :] >= W), -1)
    idx = window_partition(grid.view(1, Hp, Wp, 1), ws).reshape(-1)
    # the padding's positions first, then the tokens', each in increasing order (a stable sort)
    order = torch.argsort((idx >= 0).to(torch.int32), stable=True)
    holes, real = order[:Hp * Wp - H * W], order[Hp * Wp - H * W:]
    inv = torch.empty(H * W, dtype=torch.long, device=device)
    inv[idx[real]] = real
    return idx, holes, inv, holes.new_empty(0)


def shift_region_labels(Hp, Wp, ws, shift, device, dtype=torch.float32):
    """(1, Hp, Wp, 1) labels 0..8 of the nine regions of a grid cyclically shifted by ``shift``
    (Swin SW-MSA): after the shift, positions of different regions were not adjacent in the
    image."""
    img = torch.zeros(1, Hp, Wp, 1, device=device, dtype=dtype)
    cnt = 0
    for hs in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
        for wsl in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
            img[:, hs, wsl, :] = cnt
            cnt += 1
    return img


@shape_constant(maxsize=64)
def shift_window_mask(Hp, Wp, ws, shift, device, dtype=torch.float32):
    """Additive mask (nW, ws*ws, ws*ws) in ``dtype`` that keeps cyclically shifted windows from
    mixing regions that are not adjacent in the image (Swin SW-MSA): 0 within a region, -100
    between two. Made once per arguments (:func:`~linattn_mm.models.utils.constants.
    shape_constant`; stock Swin rebuilds it in every forward): not to be modified."""
    win = window_partition(shift_region_labels(Hp, Wp, ws, shift, device), ws).squeeze(-1)
    mask = win[:, None, :] - win[:, :, None]
    return mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0).to(dtype)


#: the attention kernels that return a gradient for the additive mask (the memory-efficient one,
#: and the decomposition where it does not apply)
_BIAS_GRAD_KERNELS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@ATTENTIONS.register_module()
class WindowSoftmaxAttention(BaseTokenMixer):
    """Swin (shifted) window attention with relative position bias, on a full token grid.

    The grid is padded at the bottom/right to a multiple of ``window_size`` (any H×W works), cyclically
    shifted for SW-MSA blocks, split into windows, and cropped back afterwards. A map that fits in
    one window is not shifted (as the official Swin, e.g. stage 4 at 224×224).

    Args:
        embed_dims (int): channels.
        num_heads (int): heads.
        window_size (int): window side. Default 7.
        shift (bool | str): ``'alternate'`` (default) shifts by ``window_size // 2`` in odd blocks of a
            stage, ``True`` always, ``False`` never.
        block_idx (int): index of the block in its stage (given by the skeleton).
        qkv_bias (bool), qk_scale (float, optional), attn_drop, proj_drop: as in Swin.

    The CPU inference form of :func:`linattn_mm.deploy.convert` runs a few thousand tokens of
    windows at a time.

    Off CPU (``fused`` None, the default) the windows attend through one
    ``F.scaled_dot_product_attention`` with the relative position bias (and the shift mask) as its
    additive mask: on a GPU the fused memory-efficient kernel, which computes the bias's gradient
    too (where the bias needs one, the kernels are limited to that one and the decomposition:
    cuDNN's attention, which torch prefers on recent GPUs under autocast, returns no gradient for
    a mask), one operation each way where the steps take about ten, and no (n, n) weights kept for
    backward (Pola-Swin-T's training step, as counted on ``meta``: 1338 -> 1190 operations). On
    CPU the weights are computed step by step, as Swin (faster there: the CPU kernel with a mask
    took 1.7x the time of the steps for a stage-3 layer's forward and backward). ``fused`` True or
    False chooses one form everywhere (the same values up to float rounding).
    """
    supports_extra_tokens = False
    fused = None

    def __init__(self, embed_dims, num_heads, window_size=7, shift='alternate', block_idx=0,
                 qkv_bias=True, qk_scale=None, attn_drop=0., proj_drop=0., init_cfg=None):
        super().__init__(embed_dims, num_heads, 0, init_cfg)
        if shift not in ('alternate', True, False):
            raise ValueError(f"shift must be 'alternate', True or False, got {shift!r}")
        self.window_size = int(window_size)
        do_shift = shift is True or (shift == 'alternate' and block_idx % 2 == 1)
        self.shift_size = self.window_size // 2 if do_shift else 0
        self.scale = qk_scale or self.head_dims ** -0.5
        ws = self.window_size
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * ws - 1) * (2 * ws - 1), num_heads))
        self.register_buffer('relative_position_index', relative_position_index((ws, ws)),
                             persistent=False)
        self.qkv = nn.Linear(embed_dims, embed_dims * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)
        nn.init.trunc_normal_(self.relative_position_bias_table, std=.02)

    def relative_position_bias(self):
        n = self.window_size ** 2
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        return bias.view(n, n, -1).permute(2, 0, 1).contiguous()  # (h, n, n)

    def resize_checkpoint_tensor(self, name, src):
        """A checkpoint's ``relative_position_bias_table`` from another window size: each head's
        table resized bicubically. Other names: not resized."""
        if name != 'relative_position_bias_table':
            return None
        from linattn_mm.checkpoint.resize import resize_relative_position_table
        return resize_relative_position_table(name, src, self.relative_position_bias_table.shape)

    def _geometry(self, hw_shape):
        """(shift, padded H, padded W) of an H×W grid."""
        H, W = hw_shape
        ws, s = self.window_size, self.shift_size
        if H <= ws and W <= ws:
            s = 0  # one window holds the whole map: no shift (as the official Swin)
        return s, H + (-H) % ws, W + (-W) % ws

    def _window_tokens(self, x, hw_shape):
        """Tokens (B, H*W, C) -> the windows (B*nW, n, C) of the padded, shifted grid."""
        B, N, C = x.shape
        H, W = hw_shape
        s, Hp, Wp = self._geometry(hw_shape)
        x = x.view(B, H, W, C)
        if Hp != H or Wp != W:
            x = F.pad(x, (0, 0, 0, Wp - W, 0, Hp - H))
        if s:
            x = torch.roll(x, shifts=(-s, -s), dims=(1, 2))
        return window_partition(x, self.window_size)

    def _layout(self, hw_shape, device):
        s, _, _ = self._geometry(hw_shape)
        return window_layout(int(hw_shape[0]), int(hw_shape[1]), self.window_size, s, device)

    def _windows(self, x, hw_shape, per_window=False):
        """Tokens -> per-window q, k, v (B*nW, h, n, d) and the additive logit bias, (1, h, n, n)
        or, for shifted windows, (nW, h, n, n) (the mask of each window's position added; with
        ``per_window`` (B*nW, h, n, n), one for each window of each image, as the fused kernel
        takes it). The
        projection runs on the H*W tokens; the padding's q, k, v are the projection of zeros (its
        bias), as in Swin, where the padded grid is projected. The padded, shifted windows are one
        gather of the projection (:class:`~linattn_mm.ops.lean_layers.GatherTokens`)."""
        B = x.shape[0]
        ws, n = self.window_size, self.window_size ** 2
        s, Hp, Wp = self._geometry(hw_shape)
        qkv = self.qkv(x)
        windows = GatherTokens.apply(qkv, *self._layout(hw_shape, x.device), self.qkv.bias)
        windows = windows.view(B * (Hp // ws) * (Wp // ws), n, qkv.shape[-1])
        q, k, v = split_heads(windows, self.num_heads * 3).chunk(3, dim=1)
        bias = self.relative_position_bias().to(q.dtype)[None]  # (1, h, n, n)
        if s:
            mask = shift_window_mask(Hp, Wp, ws, s, x.device, q.dtype)  # (nW, n, n)
            if per_window:  # (B, nW, h, n, n) in one sum
                bias = torch.add(mask[None, :, None].expand(B, -1, -1, -1, -1), bias).flatten(0, 1)
            else:
                bias = bias + mask[:, None]
        return q, k, v, bias

    has_attention_weights = True

    def attention_weights(self, x, hw_shape):
        """Dense (B, h, H*W, H*W) weights: each query's row is its (shifted) window's softmax,
        zero elsewhere. Keys on the bottom/right padding are left out, so rows of windows that
        reach into the padding sum to less than 1."""
        self.check_input(x, hw_shape)
        B = x.shape[0]
        H, W = hw_shape
        ws = self.window_size
        s, Hp, Wp = self._geometry(hw_shape)
        q, k, _, bias = self._windows(x, hw_shape)
        attn = self._attend_bias(q @ k.transpose(-2, -1) * self.scale, bias).softmax(-1)
        # the padded-grid index of every window position, in the image's (unshifted) frame
        pos = torch.arange(Hp * Wp, device=x.device).view(1, Hp, Wp, 1)
        if s:
            pos = torch.roll(pos, shifts=(-s, -s), dims=(1, 2))
        pos = window_partition(pos, ws).squeeze(-1)  # (nW, n)
        nW, n = pos.shape
        full = attn.new_zeros(B, self.num_heads, Hp * Wp, Hp * Wp)
        full[:, :, pos[:, :, None].expand(nW, n, n), pos[:, None, :].expand(nW, n, n)] = \
            attn.view(B, nW, self.num_heads, n, n).permute(0, 2, 1, 3, 4)
        keep = (torch.arange(Hp, device=x.device)[:, None] * Wp
                + torch.arange(W, device=x.device)[None, :])[:H].reshape(-1)
        return dict(weights=full[:, :, keep][:, :, :, keep], key_hw=(H, W))

    @staticmethod
    def _attend_bias(logits, bias):
        """Logits (B*nW, h, n, n) plus the bias (1 or nW, h, n, n), without repeating it."""
        nb = bias.shape[0]
        return (logits.view(-1, nb, *logits.shape[1:]) + bias).view(logits.shape)

    def forward(self, x, hw_shape):
        """``proj(softmax(q k^T / sqrt(d) + bias) v)`` in every window (as Swin), the windows'
        outputs gathered back to the H*W tokens before the output projection."""
        self.check_input(x, hw_shape)
        B, N, C = x.shape
        fused = x.device.type != 'cpu' if self.fused is None else self.fused
        q, k, v, bias = self._windows(x, hw_shape, per_window=fused)
        drop = self.attn_drop if self.training else 0.
        if fused:
            with (sdpa_kernel(_BIAS_GRAD_KERNELS) if bias.requires_grad
                  else contextlib.nullcontext()):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=drop,
                                                     scale=self.scale)
        else:
            attn = self._attend_bias((q * self.scale) @ k.transpose(-2, -1), bias).softmax(-1)
            out = (F.dropout(attn, drop) if drop > 0 else attn) @ v
        out = merge_heads(out).reshape(B, -1, C)  # (B, Hp*Wp, C), window by window
        idx, holes, inv, inv_holes = self._layout(hw_shape, x.device)
        tokens = GatherTokens.apply(out, inv, inv_holes, idx, holes, None)  # (B, H*W, C)
        return self.proj_drop(self.proj(tokens))

    def unwindow(self, out, hw_shape):
        """Window outputs (B*nW, n, C) back to tokens (B, H*W, C): reverse the partition and the
        shift, crop the padding."""
        H, W = hw_shape
        s, Hp, Wp = self._geometry(hw_shape)
        x = window_reverse(out, self.window_size, Hp, Wp)
        if s:
            x = torch.roll(x, shifts=(s, s), dims=(1, 2))
        return x[:, :H, :W, :].reshape(x.shape[0], H * W, x.shape[-1])


@ATTENTIONS.register_module()
class SRSoftmaxAttention(BaseTokenMixer):
    """PVT spatial-reduction attention: keys/values come from the grid reduced by a
    ``sr_ratio``-strided convolution (+LayerNorm), or, with ``linear=True`` (PVTv2-li), from a 7×7
    adaptive average pool followed by a 1×1 conv, LayerNorm and GELU.

    Args:
        embed_dims (int), num_heads (int): channels, heads.
        sr_ratio (int): spatial reduction of K/V (1 = none). Default 1.
        linear (bool): PVTv2 linear SRA. Default False.
        num_extra_tokens (int): class tokens; they are kept unreduced in K/V.
        qkv_bias, qk_scale, attn_drop, proj_drop: as in PVT.
    """

    def __init__(self, embed_dims, num_heads, sr_ratio=1, linear=False, num_extra_tokens=0,
                 qkv_bias=True, qk_scale=None, attn_drop=0., proj_drop=0., init_cfg=None):
        super().__init__(embed_dims, num_heads, num_extra_tokens, init_cfg)
        self.scale = qk_scale or self.head_dims ** -0.5
        self.sr_ratio = int(sr_ratio)
        self.linear = bool(linear)
        self.q = nn.Linear(embed_dims, embed_dims, bias=qkv_bias)
        self.kv = nn.Linear(embed_dims, embed_dims * 2, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)
        if self.linear:
            self.pool = nn.AdaptiveAvgPool2d(7)
            self.sr = nn.Conv2d(embed_dims, embed_dims, kernel_size=1, stride=1)
            self.norm = nn.LayerNorm(embed_dims)
            self.act = nn.GELU()
        elif self.sr_ratio > 1:
            self.sr = nn.Conv2d(embed_dims, embed_dims, kernel_size=self.sr_ratio,
                                stride=self.sr_ratio)
            self.norm = nn.LayerNorm(embed_dims)

    def reduce(self, x, hw_shape):
        """Tokens (B, N, C) -> key/value source tokens (B, n, C)."""
        if not self.linear and self.sr_ratio == 1:
            return x
        e = self.num_extra_tokens
        extra, grid = x[:, :e], x[:, e:]
        B, _, C = grid.shape
        H, W = hw_shape
        grid = nlc_to_nchw(grid, (H, W))
        if self.linear:
            grid = self.act(self.norm(self.sr(self.pool(grid)).flatten(2).transpose(1, 2)))
        else:
            if H < self.sr_ratio or W < self.sr_ratio:
                raise ValueError(f'SRSoftmaxAttention: token grid {H}x{W} is smaller than '
                                 f'sr_ratio={self.sr_ratio}; use a larger input')
            grid = self.norm(self.sr(grid).flatten(2).transpose(1, 2))
        return torch.cat([extra, grid], dim=1) if e else grid

    def key_grid(self, hw_shape):
        """The grid K/V live on."""
        H, W = hw_shape
        if self.linear:
            return (7, 7)
        return (H // self.sr_ratio, W // self.sr_ratio)

    has_attention_weights = True

    def attention_weights(self, x, hw_shape):
        self.check_input(x, hw_shape)
        q = split_heads(self.q(x), self.num_heads)
        k, _ = split_heads(self.kv(self.reduce(x, hw_shape)), self.num_heads * 2).chunk(2, dim=1)
        return dict(weights=(q @ k.transpose(-2, -1) * self.scale).softmax(-1),
                    key_hw=self.key_grid(hw_shape))

    def forward(self, x, hw_shape):
        self.check_input(x, hw_shape)
        q = split_heads(self.q(x), self.num_heads)
        k, v = split_heads(self.kv(self.reduce(x, hw_shape)), self.num_heads * 2).chunk(2, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_drop if self.training else 0., scale=self.scale)
        return self.proj_drop(self.proj(merge_heads(out)))
