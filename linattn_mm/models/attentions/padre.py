"""PADRe: polynomial attention drop-in replacement (Letourneau et al., ICLR 2025, arXiv 2407.11306).

No official code exists; this is the instance of the paper's experiments (§4.1) written from the
text, with every open choice an argument (defaults and reasons: ``docs/model_zoo/padre.md``,
"Arguments and documented choices"). One head. For tokens ``x`` on an H×W grid and degree ``d``::

    Y_i     = A_i X B_i          B_i: point-wise (Linear C->C), A_i: depth-wise k×k conv (i = 1..d)
    Z_1     = Y_1
    Z_{i+1} = (C_i Z_i D_i) ⊙ Y_{i+1}      D_i: point-wise, C_i: depth-wise k×k   (i = 1..d-1)
    P       = proj( sum_{i=2..d} w_i ⊙ Z_i )                                       (+ proj bias)

* ``w_i`` are per-degree, per-channel weights (shape (d-1, C), ones at init) and ``proj`` a
  Linear(C, C) with bias: together ``sum_i (W_proj diag(w_i)) Z_i + b``, i.e. the paper's
  ``sum_i W_i ⊙ Z_i + L`` (Eq. 6) with per-channel instead of per-token weights (the per-token
  W ∈ R^{N×D×d}, L ∈ R^{N×D} would fix the resolution) followed by the "final conv layer" that the
  paper says provides the bias.
* **No degree-1 term** (``Z_1`` is not summed): the block residual ``x + PADRe(LN(x))`` provides it.
* The convolutions are **depth-wise** (a dense 11×11 conv would hold ~4.5M parameters per layer at
  C=192, incompatible with the 5M of PADRe-2 DeiT-T); point-wise and token convs commute up to bias
  placement (A X B is associative). The B_i of all degrees are one fused Linear(C, d·C) and the A_i
  one depth-wise conv over d·C channels (same maths, fewer kernel launches).
* Nothing depends on the token count: it runs at any H×W without resizing. Zero padding (k // 2) at
  the grid border, as any CNN.

Class tokens (``num_extra_tokens > 0``, DeiT), ``cls_mode``:

* ``'pool'`` (default): the token mixings A_i / C_i act on a class-token row as
  ``alpha ⊙ t_cls + beta ⊙ mean_grid(t)`` (per-channel learnable ``alpha``, ``beta``, one pair per
  token conv, initialised to 1): the class token sees the (global average of the) grid, the grid
  does not see the class token. Still linear in X, so Z_i stays a homogeneous degree-i polynomial;
  cost O(N). Grid tokens are mixed by the k×k convs only.
* ``'identity'``: A_i / C_i are the identity on class tokens (they get only the channel mixings and
  products of their own features; use a pooled readout then, e.g. ``out_type='avg_featmap'``).

Normalisation (§3.3, "not necessary" in the paper), ``norm``:

* ``None`` (default, paper): no normalisation.
* ``'ln'``: a LayerNorm (no affine) over channels on every Y_i before the products. Bounds the
  magnitude of the degree-d products for any input scale (the output is then no longer a
  polynomial in X; use for fp16 training if it diverges).

Precision (``fp32``, default True): under autocast the whole mixer runs in float32 with autocast
disabled and its output stays float32 (the residual stream of the skeletons is float32 under
autocast). A degree-d product of unnormalised activations leaves the float16 range (max 65504)
easily, and so do the weight gradients of the input point-wise layer (sums over all tokens of
products of the other degrees' factors). The mixer is a small part of the block cost (2d point-wise
layers and 2d-1 depth-wise convs); ``fp32=False`` leaves everything to autocast.

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
               num_extra_tokens=0):
    """Analytic multiply-accumulate count of one :class:`PADReMixer` forward (biases, the Hadamard
    products and the class-token pooling are counted as 0 MACs, like fvcore / the DeiT tables).

    Args:
        embed_dims (int): C.
        degree (int): d.
        num_tokens (int): grid tokens H*W.
        kernel_size (int): k.
        token_mixing (str): ``'2d'`` (k*k taps) or ``'1d'`` (k taps).
        num_extra_tokens (int): class tokens (go through the point-wise layers only).

    Returns:
        int: MACs = (2d)·N'·C² + (2d−1)·N·C·taps, N' = N + extra tokens
        (d + (d−1) + 1 point-wise layers, d + (d−1) depth-wise convs).
    """
    taps = kernel_size ** 2 if token_mixing == '2d' else kernel_size
    n_all = num_tokens + num_extra_tokens
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

    def __init__(self, embed_dims, num_heads=1, degree=2, kernel_size=11, token_mixing='2d',
                 norm=None, fp32=True, cls_mode='pool', bias=True, num_extra_tokens=0,
                 proj_drop=0., core='fast', init_cfg=None):
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
        conv = nn.Conv2d if token_mixing == '2d' else nn.Conv1d
        pad = kernel_size // 2
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
        if num_extra_tokens and cls_mode == 'pool':
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

    def extra_repr(self):
        return (f'degree={self.degree}, kernel_size={self.kernel_size}, '
                f'token_mixing={self.token_mixing!r}, norm={self.norm!r}, '
                f'cls_mode={self.cls_mode!r}')
