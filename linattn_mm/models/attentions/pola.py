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
   pretraining grid and resized (bicubic) to the actual K/V grid in every forward; the resized
   tensor is cached in inference (eval + no grad). ``use_pos_enc=False`` drops it.
5. **DWC**: a depth-wise ``kernel_size`` conv on ``v`` with **one** (d, 1, k, k) kernel shared by
   all heads (official). The paper leaves the conv type open.
6. **Spatial reduction** (PVT layout only, ``la_sr_ratio > 1``): K/V come from a strided conv +
   LayerNorm (keys ``sr``, ``norm``) and ``v`` is brought back to ``H*W`` tokens for the DWC by 1-D
   linear interpolation over the flattened token index (official; the released Pola-PVT models use
   ``la_sr_ratio=1``).

Class tokens (``num_extra_tokens > 0``, DeiT): they take part in q, k, v, the normalisation and the
gate like grid tokens, but not in the position encoding (their PE is zero) nor in the DWC (which
runs on the H*W grid only); their output is ``attn(cls) * g(cls)``.

Fast path: by default (``fused=None``, automatic) the core runs
:func:`linattn_mm.ops.pola.polarity_attention_fast` (one ``pow`` per tensor, one query-side GEMM for
both streams and normalisers, temperature and ``n^-1/2`` scalars folded, fewer copies); it equals
the reference :func:`polarity_attention` (kept unchanged, selected by ``fused=False``) up to float
rounding, gradients included. In inference (eval + no grad) the exponent ``p``, ``1 / softplus``
and the resized position encoding are computed once and cached (invalidated when the parameters
change or the module goes back to training).

Precision: the feature map (temperature, ReLU, power) and the small matmuls run in float32 with
autocast disabled (``p`` reaches 1 + alpha, so ``relu(q/s)^p`` overflows fp16 easily); the result
is cast back to the dtype of the projections.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from linattn_mm.ops.common import call_triton, cpu_inference_call, use_triton
from linattn_mm.ops.pola import polarity_attention_fast, polarity_layer_chunked
from linattn_mm.registry import ATTENTIONS
from ..utils.grid import nlc_to_nchw, resize_grid_embed
from .base import BaseTokenMixer, merge_heads, split_heads

__all__ = ['PolaLinearAttention', 'polarity_attention', 'polarity_attention_fused']


def polarity_attention(q, k, v, p, eps=1e-6):
    """Reference polarity-aware linear attention on per-head tensors (official order of operations).

    Args:
        q (Tensor): queries after the temperature, (B, h, N, d).
        k (Tensor): keys after the position encoding and temperature, (B, h, n, d).
        v (Tensor): values, (B, h, n, d).
        p (Tensor): exponents broadcastable to (B, h, 1, d), all >= 1.
        eps (float): added to the denominators.

    Returns:
        Tensor: (B, h, N, d); channels ``[0, d_s)`` are the same-signed stream (on the first
        ``d_s = ceil(d/2)`` value channels), the rest the opposite-signed stream.
    """
    n = k.shape[-2]
    q_pos, q_neg = F.relu(q) ** p, F.relu(-q) ** p
    k_pos, k_neg = F.relu(k) ** p, F.relu(-k) ** p
    q_sim = torch.cat([q_pos, q_neg], dim=-1)
    q_opp = torch.cat([q_neg, q_pos], dim=-1)
    kk = torch.cat([k_pos, k_neg], dim=-1)
    v_sim, v_opp = v.chunk(2, dim=-1)
    k_mean = kk.mean(dim=-2, keepdim=True).transpose(-2, -1)  # (B, h, 2d, 1)
    kt = kk.transpose(-2, -1) * n ** -0.5
    z_sim = 1 / (q_sim @ k_mean + eps)
    x_sim = q_sim @ (kt @ (v_sim * n ** -0.5)) * z_sim
    z_opp = 1 / (q_opp @ k_mean + eps)
    x_opp = q_opp @ (kt @ (v_opp * n ** -0.5)) * z_opp
    return torch.cat([x_sim, x_opp], dim=-1)


def polarity_attention_fused(q, k, v, p, eps=1e-6):
    """Same result as :func:`polarity_attention` with one query-side GEMM.

    Uses ``q_opp @ X == q_sim @ swap(X)`` (swap exchanges the two d-row halves of X): with
    ``ksw = [k-, k+]``, ``kv = [kk^T v_s | ksw^T v_o] / n`` (2d x d) gives both streams from
    ``q_sim @ kv``, and the denominators are ``q_sim @ [mean(kk), mean(ksw)]``.
    """
    n = k.shape[-2]
    q_sim = torch.cat([F.relu(q) ** p, F.relu(-q) ** p], dim=-1)
    k_pos, k_neg = F.relu(k) ** p, F.relu(-k) ** p
    kk = torch.cat([k_pos, k_neg], dim=-1)
    ksw = torch.cat([k_neg, k_pos], dim=-1)
    v_sim, v_opp = v.chunk(2, dim=-1)
    kv = torch.cat([kk.transpose(-2, -1) @ v_sim, ksw.transpose(-2, -1) @ v_opp], dim=-1) / n
    k_means = torch.stack([kk.mean(dim=-2), ksw.mean(dim=-2)], dim=-1)  # (B, h, 2d, 2)
    num = q_sim @ kv  # (B, h, N, d)
    den = q_sim @ k_means + eps  # (B, h, N, 2)
    d_s = v_sim.shape[-1]
    return torch.cat([num[..., :d_s] / den[..., :1], num[..., d_s:] / den[..., 1:]], dim=-1)


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
        la_sr_ratio (int): K/V spatial reduction of the PVT layout (official ``la_sr_ratios``;
            1 in every released model). Default 1.
        pretrain_hw (tuple[int, int]): token grid at the pretraining size (given by the
            skeletons); the position encoding has ``(H0 // la_sr_ratio) * (W0 // la_sr_ratio)``
            rows. Required when ``use_pos_enc``.
        gate (str): ``'dynamic'`` (official: g from the input projection), ``'static'`` (a learnable
            per-channel G, the paper's wording) or ``'none'``. Default ``'dynamic'``.
        temperature (bool): divide q and k by ``softplus(scale)`` (official). Default True.
        use_pos_enc (bool): learnable position encoding on K (official). Default True.
        fused (bool | str | None): which core. ``None`` (default, automatic): the Triton kernel
            :func:`linattn_mm.ops.pola_triton.polarity_attention_triton` for CUDA inference (no
            gradient needed, float32 / bfloat16 / float16 inputs, Triton installed), else the
            torch fast kernel; should the Triton call fail (compiler, driver), a warning names
            the error and the torch kernel runs from then on. ``True``: always the torch fast kernel
            :func:`linattn_mm.ops.pola.polarity_attention_fast` (one ``pow`` per tensor, one
            query-side GEMM for both streams and both normalisers; equal to the reference up to
            float rounding, gradients included); in CPU inference (eval, no gradient, float32 /
            float64, dynamic gate, no class tokens, ``la_sr_ratio=1``, even head dim, no autocast)
            the whole layer then runs as :func:`linattn_mm.ops.pola.polarity_layer_chunked`, a
            few thousand tokens at a time. ``'triton'``: always the Triton kernel (an
            error where it cannot run). ``False``: the reference :func:`polarity_attention` in
            the official order of operations (for debugging and as the test oracle).
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
                 use_pos_enc=True, fused=None, eps=1e-6, num_extra_tokens=0, qkv_bias=True,
                 proj_drop=0., init_cfg=None):
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
        self.la_sr_ratio = la_sr_ratio
        self.sr_ratio = la_sr_ratio  # read by the PVT skeletons' minimum-input-size check
        self.gate_type = gate
        self.temperature = bool(temperature)
        self.use_pos_enc = bool(use_pos_enc)
        if fused is not None and fused not in (True, False, 'triton'):
            raise ValueError(f"{name}: fused must be None, True, False or 'triton', got "
                             f'{fused!r}')
        self.fused = fused
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
        self.dwc = nn.Conv2d(d, d, kernel_size=self.kernel_size, padding=self.kernel_size // 2,
                             groups=d)
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
        self._pe_cache = None
        self._coef_cache = None
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
                f'kernel_size={self.kernel_size}, la_sr_ratio={self.la_sr_ratio}, '
                f'gate={self.gate_type}, temperature={self.temperature}, '
                f'pos_enc={self.pos_enc_hw}, extra_tokens={self.num_extra_tokens}')

    # --- pieces --------------------------------------------------------------------------------
    def exponent(self):
        """p = 1 + alpha * sigmoid(power), shape (1, h, 1, d)."""
        return 1 + self.alpha * torch.sigmoid(self.power)

    def pos_enc(self, hw):
        """The position encoding on a (h, w) K/V grid, (1, h*w, C); bicubic resize of the
        pretraining table, cached in inference."""
        pe = self.positional_encoding
        if tuple(hw) == self.pos_enc_hw:
            return pe
        cacheable = not self.training and not (torch.is_grad_enabled() and pe.requires_grad)
        key = (tuple(hw), pe.device, pe.dtype, pe.data_ptr(), pe._version)
        if cacheable and self._pe_cache is not None and self._pe_cache[0] == key:
            return self._pe_cache[1]
        out = resize_grid_embed(pe, self.pos_enc_hw, hw)
        if cacheable:
            self._pe_cache = (key, out)
        else:
            self._pe_cache = None
        return out

    def train(self, mode=True):
        self._pe_cache = None
        self._coef_cache = None
        return super().train(mode)

    @property
    def use_fast_path(self):
        """True unless ``fused=False`` (the reference core)."""
        return self.fused is not False

    def _coefficients(self, dtype):
        """``p`` (1, h, 1, d) and ``1 / softplus(scale)`` as (1, h, 1, d) (or None), in ``dtype``;
        cached in inference (eval, and no grad or frozen parameters)."""
        params = [self.power] + ([self.scale] if self.temperature else [])
        cacheable = not self.training and not (
            torch.is_grad_enabled() and any(t.requires_grad for t in params))
        key = (dtype, ) + tuple((t.device, t.dtype, t.data_ptr(), t._version) for t in params)
        if cacheable and self._coef_cache is not None and self._coef_cache[0] == key:
            return self._coef_cache[1]
        p = self.exponent().to(dtype)
        inv_s = None
        if self.temperature:
            inv_s = (1 / F.softplus(self.scale.to(dtype))).reshape(
                1, self.num_heads, 1, self.head_dims)
        out = (p, inv_s)
        self._coef_cache = (key, out) if cacheable else None
        return out

    def _kv_source(self, x, hw_shape):
        """Tokens K/V are computed from, and their grid: the input, or (la_sr_ratio > 1) the grid
        reduced by the strided ``sr`` conv + ``norm`` (class tokens kept as they are)."""
        if self.la_sr_ratio == 1:
            return x, tuple(hw_shape)
        e = self.num_extra_tokens
        extra, grid = x[:, :e], x[:, e:]
        B, _, C = grid.shape
        H, W = hw_shape
        if H < self.la_sr_ratio or W < self.la_sr_ratio:
            raise ValueError(f'{type(self).__name__}: token grid {H}x{W} is smaller than '
                             f'la_sr_ratio={self.la_sr_ratio}')
        grid = self.sr(nlc_to_nchw(grid, (H, W)))
        hw = tuple(grid.shape[-2:])
        grid = self.norm(grid.flatten(2).transpose(1, 2))
        return (torch.cat([extra, grid], dim=1) if e else grid), hw

    def _project(self, x, hw_shape):
        """q (B,N,C), k/v (B,n,C), g (B,N,C) or None, and the K/V grid."""
        B, N, C = x.shape
        g = None
        if self.qkv_layout == 'qkvg':
            if self.gate_type == 'dynamic':
                q, k, v, g = self.qkvg(x).reshape(B, N, 4, C).unbind(2)
            else:
                q, k, v = self.qkv(x).reshape(B, N, 3, C).unbind(2)
            return q, k, v, g, tuple(hw_shape)
        if self.gate_type == 'dynamic':
            q, g = self.qg(x).reshape(B, N, 2, C).unbind(2)
        else:
            q = self.q(x)
        src, kv_hw = self._kv_source(x, hw_shape)
        k, v = self.kv(src).reshape(B, src.shape[1], 2, C).unbind(2)
        return q, k, v, g, kv_hw

    @staticmethod
    def _triton():
        """The Triton kernel module, imported on first use (Triton is optional)."""
        from linattn_mm.ops import pola_triton
        return pola_triton

    def _use_triton(self, q, k, v):
        """Whether this call runs the Triton core (see ``fused``)."""
        params = [self.power] + ([self.scale] if self.temperature else [])
        return use_triton(type(self).__name__, self.fused, (q, k, v), params)

    def _attend(self, q, k, v, k_bias=None):
        """Temperature, polarity feature maps and the two normalised streams with autocast off, in
        float32 (float64 inputs stay float64). q (B,N,C), k/v (B,n,C) -> (B,N,C) in v's dtype.
        ``k_bias`` (1, n, C) is added to k first (the position encoding)."""
        out_dtype = v.dtype
        if self._use_triton(q, k, v):  # reads the inputs in their own dtype, float32 inside
            h = self.num_heads
            p, inv_s = self._coefficients(torch.float32)
            out = call_triton(
                type(self).__name__, self.fused, self._triton().polarity_attention_triton,
                split_heads(q, h), split_heads(k, h), split_heads(v, h), p, self.eps,
                inv_scale=inv_s, k_bias=None if k_bias is None else split_heads(k_bias, h),
                out_dtype=out_dtype)
            if out is not None:  # None: a failed automatic call, the torch kernel takes over
                return merge_heads(out)
        work = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        work = torch.promote_types(work, torch.float32)  # fp16/bf16 -> fp32; fp64 stays
        with torch.autocast(device_type=q.device.type, enabled=False):
            q, k, v = q.to(work), k.to(work), v.to(work)
            h = self.num_heads
            if self.use_fast_path:
                p, inv_s = self._coefficients(work)
                if k_bias is not None:
                    k_bias = split_heads(k_bias.to(work), h)
                out = polarity_attention_fast(split_heads(q, h), split_heads(k, h),
                                              split_heads(v, h), p, self.eps, inv_scale=inv_s,
                                              k_bias=k_bias)
                return merge_heads(out).to(out_dtype)
            if k_bias is not None:
                k = k + k_bias
            if self.temperature:
                s = F.softplus(self.scale.to(work))
                q, k = q / s, k / s
            out = polarity_attention(split_heads(q, h), split_heads(k, h), split_heads(v, h),
                                     self.exponent().to(work), self.eps)
            out = merge_heads(out)
        return out.to(out_dtype)

    def _conv_term(self, v, hw_shape):
        """DWC(v) on the H×W grid with the head-shared kernel; v (B, E+n, C) -> (B, H*W, C)."""
        e = self.num_extra_tokens
        v = v[:, e:]
        B, n, C = v.shape
        H, W = hw_shape
        h, d = self.num_heads, self.head_dims
        if self.use_fast_path and n == H * W:
            # channels-last depth-wise conv over all C channels with the shared kernel tiled over
            # the heads: one copy in, and the output is already (B, H*W, C) (NCHW needs a
            # transposing copy on each side, and CPU depth-wise conv is faster channels-last)
            x = v.reshape(B, H, W, C).permute(0, 3, 1, 2).contiguous(
                memory_format=torch.channels_last)
            w = self.dwc.weight.repeat(h, 1, 1, 1)
            b = None if self.dwc.bias is None else self.dwc.bias.repeat(h)
            out = F.conv2d(x, w.to(x.dtype), None if b is None else b.to(x.dtype),
                           padding=self.dwc.padding, groups=C)
            return out.permute(0, 2, 3, 1).reshape(B, n, C)
        v = v.reshape(B, n, h, d).permute(0, 2, 3, 1).reshape(B * h, d, n)
        if n != H * W:  # la_sr_ratio > 1: 1-D linear interpolation over the token index (official)
            v = F.interpolate(v, size=H * W, mode='linear')
        out = self.dwc(v.reshape(B * h, d, H, W))
        return out.reshape(B, h * d, H * W).transpose(1, 2)

    has_attention_weights = True

    def attention_weights(self, x, hw_shape):
        """Weights of the two polarity streams (reference formulas, no fast path): ``same``
        (B, h, N, n) acts on the first ``ceil(d/2)`` value channels of each head, ``opposite`` on
        the rest; each row sums to 1 up to ``eps``. ``weights`` is their mean. The local DWC(v)
        term is not a token-to-token weight and is not included."""
        self.check_input(x, hw_shape)
        q, k, _, _, kv_hw = self._project(x, tuple(hw_shape))
        e = self.num_extra_tokens
        if self.use_pos_enc:
            pe = self.pos_enc(kv_hw)
            k = k + (F.pad(pe, (0, 0, e, 0)) if e else pe)
        if self.temperature:
            s = F.softplus(self.scale)
            q, k = q / s, k / s
        q, k = split_heads(q, self.num_heads), split_heads(k, self.num_heads)
        p = self.exponent()
        q_pos, q_neg = F.relu(q) ** p, F.relu(-q) ** p
        kk = torch.cat([F.relu(k) ** p, F.relu(-k) ** p], dim=-1)
        k_mean = kk.mean(dim=-2, keepdim=True).transpose(-2, -1)
        n = k.shape[-2]
        streams = {}
        for name, qf in (('same', torch.cat([q_pos, q_neg], -1)),
                         ('opposite', torch.cat([q_neg, q_pos], -1))):
            streams[name] = (qf @ kk.transpose(-2, -1) / n) / (qf @ k_mean + self.eps)
        return dict(weights=(streams['same'] + streams['opposite']) / 2, key_hw=tuple(kv_hw),
                    **streams)

    # --- forward -------------------------------------------------------------------------------
    def _use_chunked_layer(self, x):
        """Whether this call runs the whole layer chunk by chunk (see ``fused``)."""
        return (self.fused in (None, True) and x.dtype in (torch.float32, torch.float64)
                and self.gate_type == 'dynamic' and not self.num_extra_tokens
                and self.la_sr_ratio == 1 and self.head_dims % 2 == 0
                and cpu_inference_call(self, x))

    def _forward_chunked(self, x, hw_shape):
        C = self.embed_dims
        if self.qkv_layout == 'qkvg':
            w, b = self.qkvg.weight, self.qkvg.bias
            w_q, w_kv, w_g = w[:C], w[C:3 * C], w[3 * C:]
            b_q, b_kv, b_g = (None, ) * 3 if b is None else (b[:C], b[C:3 * C], b[3 * C:])
        else:
            w, b = self.qg.weight, self.qg.bias
            w_q, w_g = w[:C], w[C:]
            b_q, b_g = (None, None) if b is None else (b[:C], b[C:])
            w_kv, b_kv = self.kv.weight, self.kv.bias
        p, inv_s = self._coefficients(x.dtype)
        pe = self.pos_enc(hw_shape).reshape(-1, C) if self.use_pos_enc else None
        out = polarity_layer_chunked(
            x, w_q, b_q, w_kv, b_kv, w_g, b_g, self.proj.weight, self.proj.bias, p.reshape(C),
            None if inv_s is None else inv_s.reshape(C), pe, self.eps, self.num_heads,
            lambda v: self._conv_term(v, hw_shape))
        return self.proj_drop(out)

    def forward(self, x, hw_shape):
        self.check_input(x, hw_shape)
        hw_shape = tuple(hw_shape)
        if self._use_chunked_layer(x):
            return self._forward_chunked(x, hw_shape)
        q, k, v, g, kv_hw = self._project(x, hw_shape)
        e = self.num_extra_tokens
        pe = None
        if self.use_pos_enc:
            pe = self.pos_enc(kv_hw)
            pe = F.pad(pe, (0, 0, e, 0)) if e else pe
        out = self._attend(q, k, v, pe)
        conv = self._conv_term(v, hw_shape)
        inplace = self.use_fast_path and not (torch.is_grad_enabled() and (
            out.requires_grad or conv.requires_grad or (g is not None and g.requires_grad)))
        if inplace:  # inference: no new (B, N, C) buffers
            out[:, e:] += conv
        elif e:
            out = torch.cat([out[:, :e], out[:, e:] + conv], dim=1)
        else:
            out = out + conv
        if g is not None:
            out = out.mul_(g) if inplace else out * g
        elif self.gate_type == 'static':
            out = out * self.gate
        return self.proj_drop(self.proj(out))

