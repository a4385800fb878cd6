"""PolaFormer polarity-aware linear attention (Meng et al., ICLR 2025, arXiv 2501.15061).

The default computation is the one of the official code (``ZacharyMeng/PolaFormer``,
``models/pola_pvt.py`` and ``models/pola_swin.py``); parameter names are the official ones, so the
official ImageNet checkpoints load with unchanged keys. Per head, with ``d = C / h``::

    k     = k + positional_encoding                  # learnable absolute PE on the keys only
    s     = softplus(scale)                          # per-channel temperature, (1, 1, C)
    p     = 1 + alpha * sigmoid(power)               # per-head, per-channel exponent, (1, h, 1, d)
    q, k  = q / s, k / s
    q+ = relu(q)^p, q- = relu(-q)^p,  k+ = relu(k)^p, k- = relu(-k)^p
    q_sim = [q+, q-],  q_opp = [q-, q+],  kk = [k+, k-]            # (..., 2d)
    v     = [v_s, v_o]                                              # halves of d/2 channels
    x_s   = q_sim (kk^T v_s) / n  /  (q_sim . mean(kk) + eps)        # same-signed stream
    x_o   = q_opp (kk^T v_o) / n  /  (q_opp . mean(kk) + eps)        # opposite-signed stream
    x     = ([x_s, x_o] + DWC(v)) * g                                # then proj

Differences between the paper (Sec. 4, Eq. 3-9) and the official code, and what this module does:

1. **G**: the paper's "learnable sign-aware matrices" G^s, G^o are, in the code, a data-dependent
   gate ``g = W_g x + b`` (the extra C outputs of ``qg`` / ``qkvg``, no activation), applied *after*
   the DWC term is added. Default ``gate='dynamic'`` (code); ``gate='static'`` is a learnable
   per-channel vector ``gate`` (1, 1, C), initialised to ones (a literal reading of the paper);
   ``gate='none'`` drops G (paper ablation, Table 3). Without the dynamic gate the projections are
   ``q``+``kv`` (PVT layout) or ``qkv`` (Swin layout).
2. **Normalisation**: mean instead of sum, with ``k`` and ``v`` pre-scaled by ``n^-1/2`` and
   ``eps = 1e-6`` added to the denominator (algebraically Eq. 6; the FLatten AMP fix). Always used.
3. **Temperature**: ``q`` and ``k`` are divided by ``softplus(scale)`` before the ReLU / power (not
   in the paper). ``temperature=False`` drops it (no ``scale`` parameter).
4. **Position encoding**: a learnable absolute PE added to ``k`` (not in the paper), sized for the
   pretraining grid and resized (bicubic) to the actual K/V grid in every forward (the inference
   form of :func:`linattn_mm.deploy.convert` keeps the resized table). ``use_pos_enc=False`` drops
   it.
5. **DWC**: a depth-wise ``kernel_size`` conv on ``v`` with **one** (d, 1, k, k) kernel shared by
   all heads (official). The paper leaves the conv type open. ``use_dwc=False`` drops the term
   (no ``dwc`` parameters): ``x = [x_s, x_o] * g``. With ``gate='none'`` as well this is the
   paper's "polarity only" ablation row (Table 3, DeiT-T, 68.1 top-1): ``x = proj([x_s, x_o])``.
6. **Spatial reduction** (PVT layout only, ``la_sr_ratio > 1``): K/V come from a strided conv +
   LayerNorm (keys ``sr``, ``norm``) and ``v`` is brought back to ``H*W`` tokens for the DWC by 1-D
   linear interpolation over the flattened token index (official; the released Pola-PVT models use
   ``la_sr_ratio=1``).

Class tokens (``num_extra_tokens > 0``, DeiT): they take part in q, k, v, the normalisation and the
gate like grid tokens, but not in the position encoding (their PE is zero) nor in the DWC (which
runs on the H*W grid only); their output is ``attn(cls) * g(cls)``.

Kernels: the core (temperature, feature maps, the two normalised streams) runs through
:func:`linattn_mm.ops.pola.polarity_attention`, chosen once by ``core``: ``'fast'`` (default, the
torch kernel of :mod:`linattn_mm.ops.pola.fast`), ``'reference'`` (the official order of operations,
:mod:`linattn_mm.ops.pola.reference`) or ``'triton'`` (the Triton kernels, forward and backward,
CUDA only). The inference forms of the whole layer (CPU: chunk by chunk; CUDA: the Triton core)
come from :func:`linattn_mm.deploy.convert`.

Precision: the feature map (temperature, ReLU, power) and the small matmuls run in float32 with
autocast disabled (``p`` reaches 1 + alpha, so ``relu(q/s)^p`` overflows fp16 easily); the result
is cast back to the dtype of the projections.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from linattn_mm.ops.dispatch import check_core
from linattn_mm.ops.lean_layers import GatedLinear, depthwise_conv_tokens, split_linear
from linattn_mm.ops.pola import polarity_attention, polarity_weights_reference
from linattn_mm.registry import ATTENTIONS
from ..utils.grid import nchw_to_nlc, nlc_to_nchw, resize_grid_embed
from .base import BaseTokenMixer, merge_heads, split_heads

__all__ = ['PolaLinearAttention']


@ATTENTIONS.register_module()
class PolaLinearAttention(BaseTokenMixer):
    """Polarity-aware linear attention of PolaFormer (official-code form by default).

    Works as the Pola mixer of the PVT / PVTv2 skeletons (``qkv_layout='qg_kv'``: keys ``qg``,
    ``kv``), of the Swin skeleton's global stages and of DeiT (``qkv_layout='qkvg'``: key ``qkvg``,
    chunk order q, k, v, g). Attention is global over the H×W grid (the official Swin stages 1-2
    use window 56 = the whole 56×56 / 28×28 map at 224²); the position encoding is resized to the
    actual grid.

    Args:
        embed_dims (int): channels C.
        num_heads (int): heads h (head_dims d = C / h).
        qkv_layout (str): ``'qg_kv'`` (PVT: ``qg`` = Linear(C, 2C) giving q, g; ``kv`` =
            Linear(C, 2C) giving k, v, possibly from the spatially reduced grid) or ``'qkvg'``
            (Swin / DeiT: one Linear(C, 4C), chunks q, k, v, g). Default ``'qg_kv'``.
        alpha (float): exponent range, p = 1 + alpha * sigmoid(power). Default 4 (all official
            models).
        kernel_size (int): DWC kernel on V. Default 5.
        use_dwc (bool): add the depth-wise conv term DWC(v) (official). ``False`` drops it and its
            ``dwc`` parameters (with ``gate='none'``: the paper's "polarity only" ablation).
            Default True.
        la_sr_ratio (int): K/V spatial reduction of the PVT layout (official ``la_sr_ratios``;
            1 in every released model). Default 1.
        pretrain_hw (tuple[int, int]): token grid at the pretraining size (given by the
            skeletons); the position encoding has ``(H0 // la_sr_ratio) * (W0 // la_sr_ratio)``
            rows. Required when ``use_pos_enc``.
        gate (str): ``'dynamic'`` (official: g from the input projection), ``'static'`` (a learnable
            per-channel G, the paper's wording) or ``'none'``. Default ``'dynamic'``.
        temperature (bool): divide q and k by ``softplus(scale)`` (official). Default True.
        use_pos_enc (bool): learnable position encoding on K (official). Default True.
        core (str): the attention core, :func:`linattn_mm.ops.pola.polarity_attention`:
            ``'fast'`` (default: the training Function, which keeps q, k, v and small matrices
            for its analytic backward; with it the conv term and the gated output projection keep
            no copies either, :mod:`linattn_mm.ops.lean_layers`; equal to the reference up to
            float rounding, gradients included), ``'reference'`` (plain autograd of the official
            order of operations; the test oracle), ``'fused'`` (the fast core's products with
            its elementwise passes as three Triton kernels, a training core for CUDA:
            :mod:`linattn_mm.ops.pola.fused`) or ``'triton'`` (the Triton kernels with their
            Triton backward, CUDA only: ``attn_cfg=dict(..., core='triton')`` trains with them;
            :func:`linattn_mm.deploy.convert` sets it for CUDA inference).
        eps (float): added to the normaliser. Default 1e-6.
        num_extra_tokens (int): class tokens before the grid (see the module docstring).
        qkv_bias (bool): bias of the input projections. Default True.
        proj_drop (float): dropout after the output projection. Default 0.
        init_cfg (dict, optional): mmengine init config.
    """
    LAYOUTS = ('qg_kv', 'qkvg')
    GATES = ('dynamic', 'static', 'none')

    def __init__(self, embed_dims, num_heads, qkv_layout='qg_kv', alpha=4., kernel_size=5,
                 la_sr_ratio=1, pretrain_hw=None, gate='dynamic', temperature=True,
                 use_pos_enc=True, core='fast', eps=1e-6, num_extra_tokens=0, qkv_bias=True,
                 proj_drop=0., use_dwc=True, init_cfg=None):
        super().__init__(embed_dims, num_heads, num_extra_tokens, init_cfg)
        name = type(self).__name__
        if qkv_layout not in self.LAYOUTS:
            raise ValueError(f'{name}: qkv_layout must be one of {self.LAYOUTS}, got '
                             f'{qkv_layout!r}')
        if gate not in self.GATES:
            raise ValueError(f'{name}: gate must be one of {self.GATES}, got {gate!r}')
        la_sr_ratio = int(la_sr_ratio)
        if la_sr_ratio < 1:
            raise ValueError(f'{name}: la_sr_ratio must be >= 1, got {la_sr_ratio}')
        if la_sr_ratio > 1 and qkv_layout != 'qg_kv':
            raise ValueError(f"{name}: la_sr_ratio > 1 needs qkv_layout='qg_kv' (K/V from the "
                             f'reduced grid), got {qkv_layout!r}')
        if alpha <= 0:
            raise ValueError(f'{name}: alpha must be > 0, got {alpha}')
        C, h, d = embed_dims, num_heads, self.head_dims
        self.qkv_layout = qkv_layout
        self.alpha = float(alpha)
        self.kernel_size = int(kernel_size)
        if not isinstance(use_dwc, bool):
            raise TypeError(f'{name}: use_dwc must be True or False, got {use_dwc!r}')
        self.use_dwc = use_dwc
        self.la_sr_ratio = la_sr_ratio
        self.sr_ratio = la_sr_ratio  # read by the PVT skeletons' minimum-input-size check
        self.gate_type = gate
        self.temperature = bool(temperature)
        self.use_pos_enc = bool(use_pos_enc)
        self.core = check_core(name, core)
        self.eps = float(eps)

        dyn = gate == 'dynamic'
        if qkv_layout == 'qg_kv':
            if dyn:
                self.qg = nn.Linear(C, 2 * C, bias=qkv_bias)
            else:
                self.q = nn.Linear(C, C, bias=qkv_bias)
            self.kv = nn.Linear(C, 2 * C, bias=qkv_bias)
        elif dyn:
            self.qkvg = nn.Linear(C, 4 * C, bias=qkv_bias)
        else:
            self.qkv = nn.Linear(C, 3 * C, bias=qkv_bias)
        self.proj = nn.Linear(C, C)
        self.proj_drop = nn.Dropout(proj_drop)
        if la_sr_ratio > 1:
            self.sr = nn.Conv2d(C, C, kernel_size=la_sr_ratio, stride=la_sr_ratio)
            self.norm = nn.LayerNorm(C)
        if use_dwc:
            self.dwc = nn.Conv2d(d, d, kernel_size=self.kernel_size,
                                 padding=self.kernel_size // 2, groups=d)
        self.power = nn.Parameter(torch.zeros(1, h, 1, d))
        if self.temperature:
            self.scale = nn.Parameter(torch.zeros(1, 1, C))
        if gate == 'static':
            self.gate = nn.Parameter(torch.ones(1, 1, C))
        self.pos_enc_hw = None
        if self.use_pos_enc:
            if pretrain_hw is None:
                raise ValueError(f'{name}: use_pos_enc=True needs pretrain_hw (the token grid at '
                                 f'the pretraining size; the skeletons pass it)')
            ph, pw = (int(s) // la_sr_ratio for s in pretrain_hw)
            if ph < 1 or pw < 1:
                raise ValueError(f'{name}: pretrain_hw={tuple(pretrain_hw)} is smaller than '
                                 f'la_sr_ratio={la_sr_ratio}')
            self.pos_enc_hw = (ph, pw)
            self.positional_encoding = nn.Parameter(torch.zeros(1, ph * pw, C))
        self._init_linears()

    # --- weights -------------------------------------------------------------------------------
    def _init_linears(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def init_weights(self):
        """Official init: trunc-normal(0.02) linears with zero bias (done at construction and by
        the skeletons), ``power``/``scale``/``positional_encoding`` zero (p = 1 + alpha/2,
        s = ln 2), and PyTorch's default init for ``dwc`` (the official models only re-initialise
        Linear and LayerNorm layers)."""
        super().init_weights()
        if self.use_dwc:
            self.dwc.reset_parameters()
        with torch.no_grad():
            self.power.zero_()
            if self.temperature:
                self.scale.zero_()
            if self.use_pos_enc:
                self.positional_encoding.zero_()
            if self.gate_type == 'static':
                self.gate.fill_(1.)

    def resize_checkpoint_tensor(self, name, src):
        """A checkpoint's ``positional_encoding`` (1, h*w, C) from another pretraining grid: its
        grid resized bicubically to this module's (no class rows). Other names: not resized."""
        if name != 'positional_encoding':
            return None
        from linattn_mm.checkpoint.resize import resize_grid_tokens
        return resize_grid_tokens(name, src, self.positional_encoding.shape, max_extra=0)

    def extra_repr(self):
        return (f'layout={self.qkv_layout}, heads={self.num_heads}, alpha={self.alpha}, '
                f'kernel_size={self.kernel_size}, use_dwc={self.use_dwc}, '
                f'la_sr_ratio={self.la_sr_ratio}, '
                f'gate={self.gate_type}, temperature={self.temperature}, '
                f'pos_enc={self.pos_enc_hw}, extra_tokens={self.num_extra_tokens}, '
                f'core={self.core}')

    # --- pieces --------------------------------------------------------------------------------
    def exponent(self):
        """p = 1 + alpha * sigmoid(power), shape (1, h, 1, d)."""
        return 1 + self.alpha * torch.sigmoid(self.power)

    def temperature_per_head(self):
        """``s = softplus(scale)`` as (1, h, 1, d), or None without the temperature."""
        if not self.temperature:
            return None
        return F.softplus(self.scale).reshape(1, self.num_heads, 1, self.head_dims)

    def pos_enc(self, hw):
        """The position encoding on a (h, w) K/V grid, (1, h*w, C): the pretraining table,
        resized bicubically to another grid."""
        return resize_grid_embed(self.positional_encoding, self.pos_enc_hw, hw)

    def k_bias(self, kv_hw):
        """The position encoding of every K/V token (zero rows for class tokens), (1, E+n, C), or
        None without it."""
        if not self.use_pos_enc:
            return None
        pe = self.pos_enc(kv_hw)
        e = self.num_extra_tokens
        return F.pad(pe, (0, 0, e, 0)) if e else pe

    def _kv_source(self, x, hw_shape):
        """Tokens K/V are computed from, and their grid: the input, or (la_sr_ratio > 1) the grid
        reduced by the strided ``sr`` conv + ``norm`` (class tokens kept as they are)."""
        if self.la_sr_ratio == 1:
            return x, tuple(hw_shape)
        e = self.num_extra_tokens
        extra, grid = x[:, :e], x[:, e:]
        H, W = hw_shape
        if H < self.la_sr_ratio or W < self.la_sr_ratio:
            raise ValueError(f'{type(self).__name__}: token grid {H}x{W} is smaller than '
                             f'la_sr_ratio={self.la_sr_ratio}')
        grid = self.sr(nlc_to_nchw(grid, (H, W)))
        hw = tuple(grid.shape[-2:])
        grid = self.norm(nchw_to_nlc(grid))
        return (torch.cat([extra, grid], dim=1) if e else grid), hw

    def _split(self, x, linear, parts):
        """``linear(x)`` in ``parts`` chunks of C channels (through
        :class:`~linattn_mm.ops.lean_layers.SplitLinear` unless ``core='reference'``: its
        backward does not stack the chunks' gradients)."""
        return split_linear(x, linear, parts, lean=self.core != 'reference')

    def _project(self, x, hw_shape):
        """q (B,N,C), k/v (B,n,C), g (B,N,C) or None, and the K/V grid."""
        g = None
        if self.qkv_layout == 'qkvg':
            if self.gate_type == 'dynamic':
                q, k, v, g = self._split(x, self.qkvg, 4)
            else:
                q, k, v = self._split(x, self.qkv, 3)
            return q, k, v, g, tuple(hw_shape)
        if self.gate_type == 'dynamic':
            q, g = self._split(x, self.qg, 2)
        else:
            q = self.q(x)
        src, kv_hw = self._kv_source(x, hw_shape)
        k, v = self._split(src, self.kv, 2)
        return q, k, v, g, kv_hw

    def conv_term(self, v, hw_shape):
        """DWC(v) on the H×W grid with the head-shared (d, 1, k, k) kernel, (B, E+n, C) ->
        (B, H*W, C). The kernel is applied to every head's d channels: one depth-wise conv over
        all C channels with the kernel tiled over the heads, on the channels-last view of the
        tokens. With ``la_sr_ratio > 1`` the n reduced tokens are first brought back to H*W by
        1-D linear interpolation over the token index (official). None with ``use_dwc=False``."""
        if not self.use_dwc:
            return None
        if self.num_extra_tokens:  # (a slice of all tokens would cost a copy in the backward)
            v = v[:, self.num_extra_tokens:]
        B, n, C = v.shape
        H, W = hw_shape
        if n != H * W:
            v = F.interpolate(v.transpose(1, 2), size=H * W, mode='linear').transpose(1, 2)
        w = self.dwc.weight.repeat(self.num_heads, 1, 1, 1)
        b = None if self.dwc.bias is None else self.dwc.bias.repeat(self.num_heads)
        w, b = w.to(v.dtype), None if b is None else b.to(v.dtype)
        # the training form keeps no copy of the map for backward
        return depthwise_conv_tokens(v, (H, W), w, b, self.dwc.padding,
                                     lean=self.core != 'reference')

    def attend(self, q, k, v, k_bias=None):
        """The core on (B, N, C) / (B, n, C) tokens (temperature, feature maps, the two
        normalised streams) through :func:`linattn_mm.ops.pola.polarity_attention` with
        ``self.core``; ``k_bias`` (1, n, C) is added to k first. Returns (B, N, C) in v's dtype."""
        h = self.num_heads
        out = polarity_attention(
            split_heads(q, h), split_heads(k, h), split_heads(v, h), self.exponent(), self.eps,
            self.temperature_per_head(), None if k_bias is None else split_heads(k_bias, h),
            core=self.core)
        return merge_heads(out)

    has_attention_weights = True

    def attention_weights(self, x, hw_shape):
        """Weights of the two polarity streams (reference formulas): ``same`` (B, h, N, n) acts on
        the first ``ceil(d/2)`` value channels of each head, ``opposite`` on the rest; each row
        sums to 1 up to ``eps``. ``weights`` is their mean. The local DWC(v) term is not a
        token-to-token weight and is not included."""
        self.check_input(x, hw_shape)
        q, k, _, _, kv_hw = self._project(x, tuple(hw_shape))
        h, pe = self.num_heads, self.k_bias(kv_hw)
        streams = polarity_weights_reference(
            split_heads(q, h), split_heads(k, h), self.exponent(), self.eps,
            self.temperature_per_head(), None if pe is None else split_heads(pe, h))
        return dict(weights=(streams['same'] + streams['opposite']) / 2, key_hw=tuple(kv_hw),
                    **streams)

    # --- forward -------------------------------------------------------------------------------
    def forward(self, x, hw_shape):
        """``proj(([x_s, x_o] + DWC(v)) * g)``, without ``DWC(v)`` when ``use_dwc=False`` (see
        the module docstring)."""
        self.check_input(x, hw_shape)
        hw_shape = tuple(hw_shape)
        q, k, v, g, kv_hw = self._project(x, hw_shape)
        out = self.attend(q, k, v, self.k_bias(kv_hw))
        e = self.num_extra_tokens
        conv = self.conv_term(v, hw_shape)  # None with use_dwc=False: the polarity streams alone
        if conv is not None:
            conv = conv.to(out.dtype)
            # class tokens take no conv term
            out = torch.cat([out[:, :e], out[:, e:] + conv], dim=1) if e else out + conv
        if g is not None and self.core != 'reference':  # keeps out and g, not their product
            return self.proj_drop(GatedLinear.apply(out, g, self.proj.weight, self.proj.bias))
        if g is not None:
            out = out * g
        elif self.gate_type == 'static':
            out = out * self.gate
        return self.proj_drop(self.proj(out))
