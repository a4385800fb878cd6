"""PADRe: polynomial attention drop-in replacement (Letourneau et al., ICLR 2025, arXiv 2407.11306).

No official code exists; this is the instance of the paper's experiments (§4.1) written from the
text, with every open choice an argument (defaults and reasons: ``docs/model_zoo/padre.md``,
"Arguments and documented choices" and "Readings tried"). One head. The paper's framework (§3,
Eqs. 1-6), for tokens ``X`` on an H×W grid and degree ``d``::

    Y_i     = A_i X B_i                        (i = 1..d)      A: token mixing, B: channel mixing
    Z_1     = Y_1
    Z_{i+1} = (C_i Z_i D_i) ⊙ Y_{i+1}          (i = 1..d-1)    C: token mixing, D: channel mixing
    P       = sum_i W_i ⊙ Z_i + L                              (Eq. 6)

Token mixings are depth-wise k×k convs (k = 11), channel mixings point-wise (Linear C->C). The
instance has **no degree-1 term** (``Z_1`` is not summed: the block residual ``x + PADRe(LN(x))``
provides it) and no separate ``L`` (the final point-wise layers' bias is the degree-0 term). Two
layouts of the per-degree modules (``layout``; the paper does not list them):

``layout='compact'`` (default) — the layout whose counts reproduce the paper's parameters (Table 2,
truncated to whole millions as the paper prints its softmax DeiTs) and Table 6 (FLOPs = 2 × MACs,
the convention of that table's other rows)::

    Z_1     = X                                  (A_1 = B_1 = I: the token and channel mixings of
                                                  Z_1 are C_1, D_1; A_1 B_1 then C_1 D_1 would be
                                                  two consecutive linear maps, Z_1 is not summed)
    Y_i     = X B_i                    i = 2..d  (point-wise; A_i = I)
    Z_{i+1} = (C_i Z_i D_i) ⊙ Y_{i+1}  i = 1..d-1  (D_i point-wise, C_i depth-wise k×k)
    P       = sum_{i=2..d} W_i Z_i + b           (W_i: per-degree point-wise layers, Eq. 6's
                                                  weights as channel mixings; b: the degree-0 term,
                                                  "the final convolutional layers provide the
                                                  bias terms")

  3(d−1) point-wise layers and d−1 depth-wise convs: ``3(d−1)·N·C² + (d−1)·N·C·k²`` MACs. At d = 2
  it is Conv2Former's block without its GELU, ``W_2 (DConv(X D_1) ⊙ X B_2)`` (the paper's App.
  B.2). D_1 and B_2..B_d act on the same X: one fused Linear(C, d·C) (``in_pw``: chunk 0 = X D_1,
  chunk i-1 = Y_i); W_2..W_d are one Linear((d−1)·C, C) over the concatenated Z_i (``out``: the
  sum of the per-degree layers, one bias).

``layout='full'`` — every Y_i has its own A_i and B_i, every Z_i its own C_i and D_i, and the sum
is ``proj(sum_{i=2..d} w_i ⊙ Z_i)`` with per-degree, per-channel ``w_i`` (ones at init) and one
Linear(C, C) with bias: ``2d·N·C² + (2d−1)·N·C·k²`` MACs. Parameters +10 % to +31 % of Table 2
and half of Table 6's FLOPs per added degree. B_1..B_d are one fused Linear(C, d·C) (``y_pw``),
A_1..A_d one depth-wise conv over d·C channels (``y_dw``), D_i / C_i ``z_pw[i-1]`` /
``z_dw[i-1]``, ``degree_weight`` and ``proj`` (the state-dict keys of the previous releases).

In both layouts Eq. 6's per-token W ∈ R^{N×D×d} and L ∈ R^{N×D} are not used (they would fix the
resolution): nothing depends on the token count, the mixer runs at any H×W without resizing. The
convolutions are **depth-wise** (a dense 11×11 conv would hold ~4.5M parameters per layer at
C=192, incompatible with the 5M of PADRe-2 DeiT-T); point-wise and token convs commute up to bias
placement (A X B is associative). Zero padding (k // 2) at the grid border, as any CNN.

Class tokens (``num_extra_tokens > 0``, DeiT), ``cls_mode``:

* ``'pool'`` (default): the token mixings (A_i / C_i) act on a class-token row as
  ``alpha ⊙ t_cls + beta ⊙ mean_grid(t)`` (per-channel learnable ``alpha``, ``beta``, one pair per
  token conv, initialised to 1: ``cls_z`` for the C_i, ``cls_y`` for the A_i of ``'full'``): the
  class token sees the (global average of the) grid, the grid does not see the class token. Still
  linear in X, so Z_i stays a homogeneous degree-i polynomial; cost O(N). Grid tokens are mixed by the k×k convs only.
* ``'identity'``: A_i / C_i are the identity on class tokens (they get only the channel mixings and
  products of their own features; use a pooled readout then, e.g. ``out_type='avg_featmap'``).

Normalisation (§3.3, "not necessary" in the paper), ``norm``:

* ``None`` (default, paper): no normalisation.
* ``'ln'``: a LayerNorm (no affine) over channels on every Y_i before the products (``'compact'``:
  on every chunk of ``in_pw``, i.e. X D_1 and Y_2..Y_d). Bounds the magnitude of the degree-d
  products for any input scale (the output is then no longer a polynomial in X; use for fp16
  training if it diverges).

Precision (``fp32``, default True): under autocast the whole mixer runs in float32 with autocast
disabled and its output stays float32 (the residual stream of the skeletons is float32 under
autocast). A degree-d product of unnormalised activations leaves the float16 range (max 65504)
easily, and so do the weight gradients of the input point-wise layer (sums over all tokens of
products of the other degrees' factors). The mixer is a small part of the block cost (3(d−1) or 2d
point-wise layers and d−1 or 2d−1 depth-wise convs); ``fp32=False`` leaves everything to autocast.

Token mixing for sequences (``token_mixing='1d'``): kernel-k 1-D depth-wise convs over the
flattened row-major token sequence (the paper's DSVT instance); ``'2d'`` (default) uses k×k convs on
the H×W grid (images, DETR features).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from linattn_mm.ops.dispatch import check_core
from linattn_mm.ops.lean_layers import recomputed
from linattn_mm.registry import ATTENTIONS
from .base import BaseTokenMixer, run_in_fp32
from ..utils.grid import nlc_to_nchw

__all__ = ['PADReMixer', 'padre_cost']


def padre_cost(embed_dims, degree, num_tokens, kernel_size=11, token_mixing='2d',
               num_extra_tokens=0, layout='compact'):
    """Analytic multiply-accumulate count of one :class:`PADReMixer` forward (biases, the Hadamard
    products and the class-token pooling are counted as 0 MACs, like fvcore / the DeiT tables).

    Args:
        embed_dims (int): C.
        degree (int): d.
        num_tokens (int): grid tokens H*W.
        kernel_size (int): k.
        token_mixing (str): ``'2d'`` (k*k taps) or ``'1d'`` (k taps).
        num_extra_tokens (int): class tokens (go through the point-wise layers only).
        layout (str): ``'compact'`` or ``'full'`` (see the module docstring).

    Returns:
        int: MACs, N' = N + extra tokens.
        ``'compact'``: 3(d−1)·N'·C² + (d−1)·N·C·taps (D_i, B_{i+1} and W_{i+1} point-wise, C_i
        depth-wise, i = 1..d−1);
        ``'full'``: (2d)·N'·C² + (2d−1)·N·C·taps (d + (d−1) + 1 point-wise layers, d + (d−1)
        depth-wise convs).
    """
    taps = kernel_size ** 2 if token_mixing == '2d' else kernel_size
    n_all = num_tokens + num_extra_tokens
    if layout == 'compact':
        return 3 * (degree - 1) * n_all * embed_dims ** 2 + (
            degree - 1) * num_tokens * embed_dims * taps
    point_wise = 2 * degree * n_all * embed_dims ** 2
    depth_wise = (2 * degree - 1) * num_tokens * embed_dims * taps
    return point_wise + depth_wise


@ATTENTIONS.register_module()
class PADReMixer(BaseTokenMixer):
    """Degree-d PADRe polynomial token mixer (see the module docstring for the computation).

    Args:
        embed_dims (int): channels C.
        num_heads (int): heads of the skeleton; ignored (the paper's instance has one head, §4.1),
            accepted so that any skeleton can host the mixer.
        degree (int): polynomial degree d in {2, 3, 4} (paper: 2 = "PADRe-2", 3, 4). Default 2.
        kernel_size (int): token-mixing kernel k (odd). Default 11 (paper).
        token_mixing (str): ``'2d'`` (k×k depth-wise convs on the grid, default) or ``'1d'``
            (kernel-k depth-wise convs on the flattened sequence).
        norm (str, optional): ``None`` (default, paper) or ``'ln'`` (LayerNorm without affine on
            every Y_i, for fp16 stability).
        fp32 (bool): run the mixer in float32 with autocast disabled (output float32). Default
            True.
        cls_mode (str): class-token handling, ``'pool'`` (default) or ``'identity'`` (see the
            module docstring). Only used when ``num_extra_tokens > 0``.
        bias (bool): biases of the point-wise and depth-wise layers (the output projection always
            has one: the degree-0 term). Default True.
        num_extra_tokens (int): class tokens before the grid. Default 0.
        layout (str): per-degree modules, ``'compact'`` (default: 3(d−1) point-wise layers and
            d−1 depth-wise convs, the counts of the paper's Tables 2 and 6) or ``'full'`` (2d
            point-wise layers and 2d−1 depth-wise convs, the previous default; its state-dict keys
            are unchanged). Formulas in the module docstring; the readings compared in
            ``docs/model_zoo/padre.md``, "Readings tried".
        proj_drop (float): dropout after the output projection. Default 0.
        core (str): ``'fast'`` (default: the training form, which keeps only the mixer's input for
            backward and runs the mixer once more in the backward, :func:`linattn_mm.ops.
            lean_layers.recomputed`; the same gradients) or ``'reference'`` (plain autograd).
        init_cfg (dict, optional): mmengine init config.
    """
    DEGREES = (2, 3, 4)
    NORMS = (None, 'ln')
    CLS_MODES = ('pool', 'identity')
    TOKEN_MIXINGS = ('2d', '1d')
    LAYOUTS = ('compact', 'full')

    def __init__(self, embed_dims, num_heads=1, degree=2, kernel_size=11, token_mixing='2d',
                 norm=None, fp32=True, cls_mode='pool', bias=True, num_extra_tokens=0,
                 proj_drop=0., core='fast', layout='compact', init_cfg=None):
        super().__init__(embed_dims, 1, num_extra_tokens=num_extra_tokens, init_cfg=init_cfg)
        self.skeleton_num_heads = num_heads
        if degree not in self.DEGREES:
            raise ValueError(f'PADReMixer: degree must be one of {self.DEGREES}, got {degree}')
        if norm not in self.NORMS:
            raise ValueError(f'PADReMixer: norm must be one of {self.NORMS}, got {norm!r}')
        if cls_mode not in self.CLS_MODES:
            raise ValueError(f'PADReMixer: cls_mode must be one of {self.CLS_MODES}, '
                             f'got {cls_mode!r}')
        if token_mixing not in self.TOKEN_MIXINGS:
            raise ValueError(f'PADReMixer: token_mixing must be one of {self.TOKEN_MIXINGS}, '
                             f'got {token_mixing!r}')
        if layout not in self.LAYOUTS:
            raise ValueError(f'PADReMixer: layout must be one of {self.LAYOUTS}, got {layout!r}')
        if kernel_size % 2 != 1:
            raise ValueError(f'PADReMixer: kernel_size must be odd, got {kernel_size}')
        self.core = check_core('PADReMixer', core, ('fast', 'reference'))
        C = embed_dims
        self.degree = degree
        self.kernel_size = kernel_size
        self.token_mixing = token_mixing
        self.norm = norm
        self.fp32 = fp32
        self.cls_mode = cls_mode
        self.layout = layout
        conv = nn.Conv2d if token_mixing == '2d' else nn.Conv1d
        pad = kernel_size // 2
        pool = bool(num_extra_tokens) and cls_mode == 'pool'
        if layout == 'compact':
            # D_1 (chunk 0) and B_2..B_d (chunks 1..d-1) fused: they all act on X
            self.in_pw = nn.Linear(C, degree * C, bias=bias)
            # C_1..C_{d-1} (depth-wise) and D_2..D_{d-1} (point-wise)
            self.z_dw = nn.ModuleList(
                conv(C, C, kernel_size, padding=pad, groups=C, bias=bias) for _ in range(degree - 1))
            self.z_pw = nn.ModuleList(nn.Linear(C, C, bias=bias) for _ in range(degree - 2))
            # W_2..W_d on the concatenated Z_2..Z_d, one bias (the degree-0 term)
            self.out = nn.Linear((degree - 1) * C, C)
            self.proj_drop = nn.Dropout(proj_drop)
            if pool:
                self.cls_z = nn.Parameter(torch.ones(degree - 1, 2, C))
            return
        # B_1..B_d fused (output chunk i-1 = B_i), then A_1..A_d as one depth-wise conv
        self.y_pw = nn.Linear(C, degree * C, bias=bias)
        self.y_dw = conv(degree * C, degree * C, kernel_size, padding=pad, groups=degree * C,
                         bias=bias)
        # D_i (point-wise) and C_i (depth-wise) on Z_i, i = 1..d-1
        self.z_pw = nn.ModuleList(nn.Linear(C, C, bias=bias) for _ in range(degree - 1))
        self.z_dw = nn.ModuleList(
            conv(C, C, kernel_size, padding=pad, groups=C, bias=bias) for _ in range(degree - 1))
        # per-degree, per-channel output weights w_2..w_d and the final projection (+ bias)
        self.degree_weight = nn.Parameter(torch.ones(degree - 1, C))
        self.proj = nn.Linear(C, C)
        self.proj_drop = nn.Dropout(proj_drop)
        if pool:
            # (alpha, beta) for A (d·C channels) and for each C_i
            self.cls_y = nn.Parameter(torch.ones(2, degree * C))
            self.cls_z = nn.Parameter(torch.ones(degree - 1, 2, C))

    # ---------------------------------------------------------------------------------------------
    def _token_mix(self, t, conv, hw_shape, cls_ab):
        """Apply one token mixing A (depth-wise conv on the grid; class rows as in ``cls_mode``).

        Args:
            t (Tensor): (B, N, c) tokens, class tokens first.
            conv (nn.Module): the depth-wise conv over c channels.
            hw_shape (tuple): (H, W).
            cls_ab (Tensor, optional): (2, c) alpha / beta for class rows (``'pool'``).
        """
        e = self.num_extra_tokens
        H, W = hw_shape
        B, _, c = t.shape
        grid = t[:, e:]
        if self.token_mixing == '2d':
            g = nlc_to_nchw(grid, (H, W))
            g = conv(g).flatten(2).transpose(1, 2)
        else:
            g = conv(grid.transpose(1, 2)).transpose(1, 2)
        if not e:
            return g
        cls = t[:, :e]
        if cls_ab is not None:
            cls = cls_ab[0] * cls + cls_ab[1] * grid.mean(dim=1, keepdim=True)
        return torch.cat([cls, g], dim=1)

    def _normalise(self, y):
        return F.layer_norm(y, y.shape[-1:]) if self.norm == 'ln' else y

    def forward(self, x, hw_shape):
        """Args: x (Tensor): (B, N, C), N = num_extra_tokens + H*W; hw_shape: (H, W).

        Returns: Tensor (B, N, C) (float32 under autocast when ``fp32``)."""
        self.check_input(x, hw_shape)
        if self.core == 'fast':
            return recomputed(self._mix, x, tuple(hw_shape))
        return self._mix(x, hw_shape)

    def _mix(self, x, hw_shape):
        return run_in_fp32(self._forward, x, hw_shape, enabled=self.fp32)

    def _forward(self, x, hw_shape):
        pool = self.num_extra_tokens and self.cls_mode == 'pool'
        if self.layout == 'compact':
            return self._compact(x, hw_shape, pool)
        y = self._token_mix(self.y_pw(x), self.y_dw, hw_shape, self.cls_y if pool else None)
        return self._recursion(y.split(self.embed_dims, dim=-1), hw_shape, pool)

    def _recursion(self, ys, hw_shape, pool):
        ys = [self._normalise(t) for t in ys]
        z = ys[0]
        s = 0
        for i in range(self.degree - 1):
            z = self._token_mix(self.z_pw[i](z), self.z_dw[i], hw_shape,
                                self.cls_z[i] if pool else None) * ys[i + 1]
            s = s + self.degree_weight[i] * z
        return self.proj_drop(self.proj(s))

    def _compact(self, x, hw_shape, pool):
        # chunk 0: Z_1 D_1 = X D_1; chunks 1..d-1: Y_2..Y_d = X B_i
        ts = [self._normalise(t) for t in self.in_pw(x).split(self.embed_dims, dim=-1)]
        zs = []
        t = ts[0]
        for i in range(self.degree - 1):
            if i:  # D_{i+1} on Z_{i+1} (D_1 is fused in in_pw)
                t = self.z_pw[i - 1](zs[-1])
            z = self._token_mix(t, self.z_dw[i], hw_shape, self.cls_z[i] if pool else None)
            zs.append(z * ts[i + 1])
        return self.proj_drop(self.out(torch.cat(zs, dim=-1) if len(zs) > 1 else zs[0]))

    def extra_repr(self):
        return (f'layout={self.layout!r}, degree={self.degree}, kernel_size={self.kernel_size}, '
                f'token_mixing={self.token_mixing!r}, norm={self.norm!r}, '
                f'cls_mode={self.cls_mode!r}')
