"""Poly-NL and Poly-SA: third-order polynomial non-local block and self-attention (Babiloni et al.,
"Linear Complexity Self-Attention with 3rd Order Polynomials", TPAMI; ICCV'21 arXiv 2107.02859).

No official code exists. Every choice the paper leaves open is an argument; the defaults and the
reason for each are listed in ``docs/model_zoo/poly.md``.

**Poly-NL** (§4.1, Eq. 9-10), :class:`PolyNL2d`, on an NCHW map X (N = H·W positions)::

    h = reduce(X)                       1x1 conv C -> C/r (r = reduction; none when r = 1)
    Y = W3( Psi(W1 h ⊙ W2 h) ⊙ h )      W1, W2, W3: 1x1 convs C/r -> C/r; Psi = mean over positions
    Z = alpha * X + beta * expand(Y)    expand: 1x1 conv C/r -> C; alpha = 1, beta = 0 at init

so inserting the block into a pretrained network starts as the identity. ``order=2`` is the
paper's second-order ablation (``Psi(W1 h)`` instead of ``Psi(W1 h ⊙ W2 h)``, §5.1.4).

**Poly-SA** (§4.2, Eq. 18), :class:`PolySelfAttention`, per head on tokens::

    Y = Q ⊙ p1 sigma( p2^T (K ⊙ V) )

``p2`` pools ``K ⊙ V`` over the positions with learned per-position weights (a generalised mean),
``sigma`` normalises the pooled ``d``-vector, and ``p1`` spreads it back over the positions. No
N×N matrix exists: the cost is O(N·C) beyond the projections. Variants, chosen by the skeleton's
context and the config:

* global (DeiT / ViT, any grid): ``p1, p2`` hold one weight per token of the pretraining grid (and
  separate rows for class tokens), resized to the actual grid like position embeddings;
* windows (``window_size`` set, Swin): pooling inside each (shifted) window; a shifted window pools
  each of its shift regions separately, so the regions that the Swin mask keeps apart stay apart
  (and grid padding is never pooled); ``p1, p2`` hold ``window_size**2`` weights, no resizing;
* spatial reduction (``sr_ratio > 1`` from a PVT skeleton): K and V come from the PVT-reduced grid
  (strided conv + LayerNorm, official PVT names ``sr``/``norm``), ``p2`` is sized to that grid and
  ``p1`` to the full grid.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from linattn_mm.ops.dispatch import check_core
from linattn_mm.ops.lean_layers import recomputed
from linattn_mm.ops.poly import poly_pool, poly_spread, region_onehot
from linattn_mm.registry import ATTENTIONS, register_backbone
from ..utils.grid import nlc_to_nchw, resize_grid_embed
from .base import BaseTokenMixer, merge_heads, run_in_fp32, split_heads
from ..utils.constants import shape_constant
from .softmax import shift_region_labels, window_partition, window_reverse

__all__ = ['PolyNL2d', 'PolySelfAttention', 'poly_pool', 'poly_spread', 'region_onehot',
           'shift_region_ids', 'polynl_cost']


@shape_constant(maxsize=64)
def shift_region_ids(H, W, window_size, shift, device):
    """Region id of every position of the padded, cyclically shifted ``Hp × Wp`` grid, laid out as
    windows: (nW, ws*ws) with ids 0..8 (the nine Swin shift regions of
    :func:`~linattn_mm.models.attentions.softmax.shift_region_labels`; all 0 without shift) and -1
    for the bottom/right padding added to reach multiples of ``window_size``. Two positions of one
    window may be pooled together exactly when the Swin shift mask lets them attend each other (and
    neither is padding). Made once per arguments (:func:`~linattn_mm.models.utils.constants.
    shape_constant`): not to be modified."""
    ws = window_size
    Hp, Wp = H + (-H) % ws, W + (-W) % ws
    if shift:
        ids = shift_region_labels(Hp, Wp, ws, shift, device, dtype=torch.long)
    else:
        ids = torch.zeros(1, Hp, Wp, 1, device=device, dtype=torch.long)
    pad = torch.zeros(1, Hp, Wp, 1, device=device, dtype=torch.bool)
    pad[:, H:] = True
    pad[:, :, W:] = True
    if shift:  # padding moves with the content
        pad = torch.roll(pad, shifts=(-shift, -shift), dims=(1, 2))
    ids = ids.masked_fill(pad, -1)
    return window_partition(ids, ws).squeeze(-1)


# ------------------------------------------------------------------------------------------------
# Poly-NL
# ------------------------------------------------------------------------------------------------
def polynl_cost(in_channels, num_positions, reduction=4, order=3):
    """Multiply-accumulates of one :class:`PolyNL2d` forward counted like fvcore (1x1 convs only;
    biases, Hadamard products and the mean are 0): ``N·(2·C·C' + k·C'^2)`` with ``C' = C/r`` and
    ``k = 3`` 1x1 convs on C' channels (``2`` for ``order=2``); without reduction ``N·k·C^2``."""
    c = in_channels // reduction
    k = 3 if order == 3 else 2
    io = 2 * in_channels * c if reduction > 1 else 0
    return num_positions * (io + k * c * c)


@register_backbone
class PolyNL2d(nn.Module):
    """Poly-NL block (third-order polynomial non-local block) on an NCHW map.

    ``Z = alpha * X + beta * expand(W3(Psi(W1 h ⊙ W2 h) ⊙ h))``, ``h = reduce(X)``, Psi = mean over
    the (valid) positions. Linear in the number of positions; no N×N matrix.

    Usable (a) as an mmdet / mmseg ResNet plugin through the stock ``plugins=`` argument (it keeps
    its own skip: the output replaces the residual branch, as mmcv's ``NonLocal2d``), e.g.
    ``plugins=[dict(cfg=dict(type='PolyNL2d', reduction=4), stages=(False, False, True, False),
    position='after_conv3')]`` (note: ``stages`` puts it into *every* block of that stage), and
    (b) as one block before the last residual block of res4, the paper's placement, in
    :class:`~linattn_mm.models.backbones.PolyNLResNet`.

    Args:
        in_channels (int): channels C.
        reduction (int): bottleneck reduction r: a 1x1 conv C -> C/r before and C/r -> C after
            the polynomial (the paper's ImageNet / COCO setting is 4). 1 = no bottleneck.
            Default 4.
        order (int): 3 (Poly-NL) or 2 (the paper's second-order ablation). Default 3.
        alpha_init (float): initial alpha (weight of the input). Default 1.
        beta_init (float): initial beta (weight of the polynomial); 0 makes the block the identity
            at insertion. Default 0.
        bias (bool): biases of the 1x1 convs (the paper does not say). Default True.
        fp32 (bool): under autocast run the block in float32 (the mean over positions of products
            of activations can leave the float16 range). Default True.

    Padding: ``forward(x, valid_mask=None)``. With a ``valid_mask`` (B, 1, H, W) or (B, H, W) of
    1 (image) / 0 (zero padding of a batch), Psi averages over the valid positions only, so the
    padding of a detection batch does not bias it. Without a mask every position counts (as mmcv's
    ``ContextBlock``): the ResNet plugin route has no mask; :class:`PolyNLResNet` infers one.
    """
    _abbr_ = 'polynl_block'
    ORDERS = (2, 3)

    def __init__(self, in_channels, reduction=4, order=3, alpha_init=1.0, beta_init=0.0,
                 bias=True, fp32=True):
        super().__init__()
        if order not in self.ORDERS:
            raise ValueError(f'PolyNL2d: order must be one of {self.ORDERS}, got {order}')
        if reduction < 1 or in_channels % reduction:
            raise ValueError(f'PolyNL2d: in_channels={in_channels} must be divisible by '
                             f'reduction={reduction} (>= 1)')
        self.in_channels = in_channels
        self.reduction = reduction
        self.order = order
        self.fp32 = fp32
        c = in_channels // reduction
        self.reduce = nn.Conv2d(in_channels, c, 1, bias=bias) if reduction > 1 else None
        self.w1 = nn.Conv2d(c, c, 1, bias=bias)
        self.w2 = nn.Conv2d(c, c, 1, bias=bias) if order == 3 else None
        self.w3 = nn.Conv2d(c, c, 1, bias=bias)
        self.expand = nn.Conv2d(c, in_channels, 1, bias=bias) if reduction > 1 else None
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))
        self.beta = nn.Parameter(torch.tensor(float(beta_init)))

    def forward(self, x, valid_mask=None):
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f'PolyNL2d: expected (B, {self.in_channels}, H, W), got '
                             f'{tuple(x.shape)}')
        return run_in_fp32(self._forward, x, valid_mask, enabled=self.fp32)

    def _forward(self, x, valid_mask):
        h = self.reduce(x) if self.reduce is not None else x
        prod = self.w1(h) * self.w2(h) if self.order == 3 else self.w1(h)
        if valid_mask is None:
            g = prod.mean(dim=(2, 3), keepdim=True)
        else:
            m = valid_mask.reshape(x.shape[0], 1, *x.shape[-2:]).to(prod.dtype)
            count = m.sum(dim=(2, 3), keepdim=True)
            if (count == 0).any():
                raise ValueError('PolyNL2d: valid_mask has an image without valid positions')
            g = (prod * m).sum(dim=(2, 3), keepdim=True) / count
        y = self.w3(g * h)
        if self.expand is not None:
            y = self.expand(y)
        return self.alpha * x + self.beta * y

    def extra_repr(self):
        return f'in_channels={self.in_channels}, reduction={self.reduction}, order={self.order}'


# ------------------------------------------------------------------------------------------------
# Poly-SA
# ------------------------------------------------------------------------------------------------
@ATTENTIONS.register_module()
class PolySelfAttention(BaseTokenMixer):
    """Poly-SA token mixer, ``Y = Q ⊙ p1 sigma(p2^T (K ⊙ V))`` per head (paper Eq. 18).

    Args:
        embed_dims (int), num_heads (int): channels and heads (p1, p2 are per head).
        sigma (str): the normalisation of the pooled vector, which Eq. 18 leaves undefined:
            ``'layernorm'`` (default; LayerNorm over the head dims with affine weights shared by
            the heads, as the only public implementation), ``'softmax'`` (over the head dims, Eq.
            11's sigma), ``'sigmoid'`` or ``'identity'``.
        proj (str): output projection: ``'dwconv'`` (default; a 3x3 depth-wise conv on the token
            grid that mixes the heads' content, the paper's choice for DeiT and Swin, §5.2.2; the
            parameter counts show it replaces the C×C projection) or ``'linear'`` (Linear C -> C).
            A class token goes through the conv as an isolated 1x1 map (centre tap and bias).
        p_init (str): ``'mean'`` (default): p2 = 1/n (Psi, the paper's Eq. 16 mean pooling) and
            p1 = 1, so training starts from Eq. 16; ``'trunc_normal'``: both truncated normal
            with std 0.02 (the public implementation).
        rescale_p2 (bool): when p2 is resized from the pretraining grid to another one, scale it by
            (pretraining positions / actual positions), so that it stays a weighted *mean* (its sum
            over the grid is unchanged). Default True. The checkpoint resizer does the same.
        window_size (int, optional): pool inside (shifted) windows of this size (Swin). None
            (default): pool over the whole grid.
        shift (bool | str): windows only: ``'alternate'`` (shift by ``window_size // 2`` in odd
            blocks of a stage, default), True or False. A map that fits in one window is not
            shifted (as the Swin skeleton).
        spatial_reduction (bool): with ``sr_ratio > 1`` from a PVT skeleton, compute K and V on the
            PVT-reduced grid (default True); False keeps full-resolution K/V (the CvT precedent of
            the paper, §5.2.2).
        sr_ratio (int): K/V spatial reduction (skeleton context). Default 1.
        pretrain_hw (tuple): the token grid of the pretraining resolution (skeleton context); p1
            and p2 are sized for it. Default (14, 14).
        block_idx (int): index of the block in its stage (skeleton context; for ``shift``).
        num_extra_tokens (int): class tokens before the grid; they have their own p1/p2 entries
            (kept apart when the grid part is resized) and are pooled like grid tokens.
        qkv_bias (bool): biases of the Q/K/V projections. Default True.
        proj_drop (float): dropout after the projection.
        fp32 (bool): under autocast, run the pooling and products in float32 (a sum over all
            tokens of products can leave the float16 range). Default True.
        core (str): ``'fast'`` (default: the training form, which keeps only the mixer's input for
            backward and runs the mixer once more in the backward, :func:`linattn_mm.ops.
            lean_layers.recomputed`; the same gradients) or ``'reference'`` (plain autograd).
    """
    SIGMAS = ('layernorm', 'softmax', 'sigmoid', 'identity')
    PROJS = ('dwconv', 'linear')
    P_INITS = ('mean', 'trunc_normal')

    def __init__(self, embed_dims, num_heads, sigma='layernorm', proj='dwconv', p_init='mean',
                 rescale_p2=True, window_size=None, shift='alternate', spatial_reduction=True,
                 sr_ratio=1, pretrain_hw=(14, 14), block_idx=0, num_extra_tokens=0,
                 qkv_bias=True, proj_drop=0., fp32=True, core='fast', init_cfg=None):
        super().__init__(embed_dims, num_heads, num_extra_tokens, init_cfg)
        name = type(self).__name__
        for arg, val, valid in (('sigma', sigma, self.SIGMAS), ('proj', proj, self.PROJS),
                                ('p_init', p_init, self.P_INITS)):
            if val not in valid:
                raise ValueError(f'{name}: {arg} must be one of {valid}, got {val!r}')
        if shift not in ('alternate', True, False):
            raise ValueError(f"{name}: shift must be 'alternate', True or False, got {shift!r}")
        if window_size is not None and (num_extra_tokens or (sr_ratio > 1 and spatial_reduction)):
            raise ValueError(f'{name}: window_size is for Swin-style grids; it cannot be combined '
                             f'with class tokens or spatial reduction (sr_ratio={sr_ratio})')
        self.core = check_core(name, core, ('fast', 'reference'))
        self.sigma = sigma
        self.proj_type = proj
        self.p_init = p_init
        self.rescale_p2 = rescale_p2
        self.fp32 = fp32
        self.window_size = int(window_size) if window_size else None
        do_shift = shift is True or (shift == 'alternate' and block_idx % 2 == 1)
        self.shift_size = self.window_size // 2 if (self.window_size and do_shift) else 0
        self.sr_ratio = int(sr_ratio) if spatial_reduction else 1
        C, h, e = embed_dims, num_heads, num_extra_tokens
        if self.window_size:
            self.q_hw = self.kv_hw = (self.window_size, self.window_size)
        else:
            self.q_hw = tuple(int(s) for s in pretrain_hw)
            self.kv_hw = tuple(max(s // self.sr_ratio, 1) for s in self.q_hw)
        if self.sr_ratio > 1:
            self.q = nn.Linear(C, C, bias=qkv_bias)
            self.kv = nn.Linear(C, 2 * C, bias=qkv_bias)
            self.sr = nn.Conv2d(C, C, kernel_size=self.sr_ratio, stride=self.sr_ratio)
            self.norm = nn.LayerNorm(C)
        else:
            self.qkv = nn.Linear(C, 3 * C, bias=qkv_bias)
        # p1 / p2 laid out like position embeddings: (1, extra + grid, heads)
        self.p1 = nn.Parameter(torch.empty(1, e + self.q_hw[0] * self.q_hw[1], h))
        self.p2 = nn.Parameter(torch.empty(1, e + self.kv_hw[0] * self.kv_hw[1], h))
        if sigma == 'layernorm':
            self.sigma_norm = nn.LayerNorm(self.head_dims)
        if proj == 'dwconv':
            self.proj = nn.Conv2d(C, C, 3, padding=1, groups=C)
        else:
            self.proj = nn.Linear(C, C)
        self.proj_drop = nn.Dropout(proj_drop)
        self.reset_tables()

    # ---------------------------------------------------------------------------------------------
    def reset_tables(self):
        """Initialise p1 / p2 as ``p_init`` says."""
        with torch.no_grad():
            if self.p_init == 'mean':
                self.p1.fill_(1.0)
                self.p2.fill_(1.0 / self.p2.shape[1])
            else:
                nn.init.trunc_normal_(self.p1, std=.02)
                nn.init.trunc_normal_(self.p2, std=.02)

    def init_weights(self):
        # the skeletons' default init treats every Linear/Conv; the tables are this module's own
        super().init_weights()
        self.reset_tables()

    def resize_checkpoint_tensor(self, name, src):
        """``p1`` / ``p2`` of a checkpoint from another pretraining grid (or window): resized like
        a position embedding (class rows kept, grid bicubic). With ``rescale_p2`` the grid part of
        ``p2`` is also scaled by (checkpoint positions / model positions), keeping its sum, as
        :meth:`_table` does for an input of another size. Other names: not resized."""
        if name not in ('p1', 'p2'):
            return None
        from linattn_mm.checkpoint.resize import resize_grid_tokens, split_grid_tokens
        dst_shape = getattr(self, name).shape
        out, note = resize_grid_tokens(name, src, dst_shape, max_extra=1)
        n_src = split_grid_tokens(name, src.shape[-2], 1, 'checkpoint')[1] ** 2
        e_dst, side = split_grid_tokens(name, dst_shape[-2], 1, 'model')
        if name == 'p2' and self.rescale_p2 and n_src != side * side:
            out = out.clone()
            out[..., e_dst:, :] *= n_src / (side * side)
            note = '; '.join(n for n in (note, f'grid part scaled by {n_src}/{side * side}') if n)
        return out, note

    def _table(self, table, src_hw, dst_hw, rescale):
        """(1, e + grid, h) table for the actual grid -> (h, e + n)."""
        e = self.num_extra_tokens
        t = resize_grid_embed(table, src_hw, dst_hw, e)
        if rescale and tuple(src_hw) != tuple(dst_hw):
            ratio = (src_hw[0] * src_hw[1]) / (dst_hw[0] * dst_hw[1])
            t = torch.cat([t[:, :e], t[:, e:] * ratio], dim=1)
        return t[0].transpose(0, 1)

    def _sigma(self, s):
        if self.sigma == 'layernorm':
            return F.layer_norm(s, s.shape[-1:], self.sigma_norm.weight.to(s.dtype),
                                self.sigma_norm.bias.to(s.dtype), self.sigma_norm.eps)
        if self.sigma == 'softmax':
            return s.softmax(dim=-1)
        if self.sigma == 'sigmoid':
            return s.sigmoid()
        return s

    def _project(self, y, hw_shape):
        if self.proj_type == 'linear':
            return self.proj_drop(self.proj(y))
        e = self.num_extra_tokens
        H, W = hw_shape
        B, _, C = y.shape
        grid = nlc_to_nchw(y[:, e:], (H, W))
        grid = F.conv2d(grid, self.proj.weight.to(y.dtype), self.proj.bias.to(y.dtype), padding=1,
                        groups=C).flatten(2).transpose(1, 2)
        if e:
            centre = self.proj.weight[:, 0, 1, 1].to(y.dtype)
            cls = y[:, :e] * centre + self.proj.bias.to(y.dtype)
            grid = torch.cat([cls, grid], dim=1)
        return self.proj_drop(grid)

    # ---------------------------------------------------------------------------------------------
    def forward(self, x, hw_shape):
        """x: (B, N, C) with N = num_extra_tokens + H*W; returns (B, N, C) (float32 under autocast
        when ``fp32``)."""
        self.check_input(x, hw_shape)
        if self.core == 'fast':
            return recomputed(self._mix, x, tuple(hw_shape))
        return self._mix(x, hw_shape)

    def _mix(self, x, hw_shape):
        if self.window_size:
            q, k, v = self._qkv_windows(x, hw_shape)
        else:
            q, k, v, kv_hw = self._qkv_global(x, hw_shape)
        core = self._core_windows if self.window_size else self._core_global
        args = (hw_shape, ) if self.window_size else (hw_shape, kv_hw)
        y = run_in_fp32(lambda q_, k_, v_: core(q_, k_.to(q_.dtype), v_.to(q_.dtype), *args),
                        q, k, v, enabled=self.fp32)
        return self._project(y, hw_shape)

    def _qkv_global(self, x, hw_shape):
        h = self.num_heads
        if self.sr_ratio == 1:
            q, k, v = split_heads(self.qkv(x), 3 * h).chunk(3, dim=1)
            return q, k, v, tuple(hw_shape)
        e = self.num_extra_tokens
        H, W = hw_shape
        if H < self.sr_ratio or W < self.sr_ratio:
            raise ValueError(f'{type(self).__name__}: token grid {H}x{W} is smaller than '
                             f'sr_ratio={self.sr_ratio}; use a larger input')
        B, _, C = x.shape
        grid = nlc_to_nchw(x[:, e:], (H, W))
        red = self.sr(grid)
        kv_hw = tuple(red.shape[-2:])
        red = self.norm(red.flatten(2).transpose(1, 2))
        if e:
            red = torch.cat([x[:, :e], red], dim=1)
        q = split_heads(self.q(x), h)
        k, v = split_heads(self.kv(red), 2 * h).chunk(2, dim=1)
        return q, k, v, kv_hw

    def _core_global(self, q, k, v, hw_shape, kv_hw):
        p1 = self._table(self.p1.to(q.dtype), self.q_hw, hw_shape, rescale=False)
        p2 = self._table(self.p2.to(q.dtype), self.kv_hw, kv_hw, rescale=self.rescale_p2)
        s = self._sigma(poly_pool(k * v, p2))
        return merge_heads(poly_spread(q, p1, s))

    def _window_geometry(self, hw_shape):
        H, W = hw_shape
        ws = self.window_size
        s = 0 if (H <= ws and W <= ws) else self.shift_size
        return H, W, ws, s, H + (-H) % ws, W + (-W) % ws

    def _qkv_windows(self, x, hw_shape):
        B, _, C = x.shape
        H, W, ws, s, Hp, Wp = self._window_geometry(hw_shape)
        g = x.view(B, H, W, C)
        if Hp != H or Wp != W:
            g = F.pad(g, (0, 0, 0, Wp - W, 0, Hp - H))
        if s:
            g = torch.roll(g, shifts=(-s, -s), dims=(1, 2))
        q, k, v = split_heads(self.qkv(window_partition(g, ws)), 3 * self.num_heads).chunk(3, dim=1)
        return q, k, v

    def _core_windows(self, q, k, v, hw_shape):
        H, W, ws, s, Hp, Wp = self._window_geometry(hw_shape)
        nW = (Hp // ws) * (Wp // ws)
        Bw = q.shape[0]
        region = shift_region_ids(H, W, ws, s, q.device).repeat(Bw // nW, 1)  # (B*nW, n)
        regions = region_onehot(region, 9 if s else 1, q.dtype)  # 9 Swin shift regions
        p1 = self.p1[0].to(q.dtype).transpose(0, 1)
        p2 = self.p2[0].to(q.dtype).transpose(0, 1)
        pooled = self._sigma(poly_pool(k * v, p2, regions))
        y = merge_heads(poly_spread(q, p1, pooled, regions))  # (B*nW, n, C)
        g = window_reverse(y, ws, Hp, Wp)
        if s:
            g = torch.roll(g, shifts=(s, s), dims=(1, 2))
        B = g.shape[0]
        return g[:, :H, :W, :].reshape(B, H * W, -1)

    def extra_repr(self):
        where = f'window_size={self.window_size}' if self.window_size else \
            f'grid={self.q_hw}, kv_grid={self.kv_hw}'
        return f'sigma={self.sigma!r}, proj={self.proj_type!r}, {where}'
