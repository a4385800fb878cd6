"""NaLaFormer norm-aware linear attention (Meng et al., arXiv 2506.21137) and the gated softmax
block of the released NaLaFormer hierarchy.

The default computation is the one of the official code (``ZacharyMeng/NaLaFormer``,
``NaLaformer/NALA.py``); parameter names are the official ones (``qkvg``, ``lepe``, ``ln``,
``out_proj``), so official checkpoints load with unchanged keys. Per head, with ``d = C / h``,
``lam = 3`` and ``eps = 1e-6``::

    q, k, v, g = qkvg(x).chunk(4)                     # float32 from here on
    k     = k ** lam                                  # sign kept, key norm kept
    qn    = ||q||_2                                   # per token
    p     = lam * (0.5 + tanh(qn))                    # per-token power in [1.5, 4.5)
    phi_q = [relu(q / qn) ** p ; relu(-q / qn) ** p]  # (N, 2d), non-negative
    phi_k = [relu(k) ; relu(-k)]                      # (N, 2d), non-negative
    z     = 1 / (phi_q . mean_j(phi_k) + eps)         # denominator: unrotated features
    out   = R(phi_q) (R(phi_k)^T v) / N * z           # numerator: 2-D RoPE R on both halves
    out   = LN(out + LePE(v)) * SiLU(g)               # LePE: 5x5 depth-wise conv on v
    out   = out_proj(out)

``phi_q . phi_k`` keeps the products of same-signed dimensions of ``d(q)`` and ``k^3`` and drops the
opposite-signed ones (the code's reading of the paper's "cosine inhibit").

Paper vs. official code, and what this module does:

1. **Kernel.** The paper (Eq. 12-17, App. A.2) maps each direction element with
   ``f(x) = pi/4 * tanh(x)`` and uses ``phi_q = |d(q)|^p(||q||) * [cos f(d(q)); sin f(d(q))]`` and
   ``phi_k = |k|^lam * [cos f(d(k)); sin f(d(k))]``, so that
   ``phi_q . phi_k = sum_i |d(q)_i|^p |k_i|^lam cos(f(d(q)_i) - f(d(k)_i)) >= 0``.
   The code uses the ReLU sign split above. Default ``kernel='official'``; ``kernel='paper'`` gives
   the cos/sin kernel (same parameters, different function: weights are not interchangeable).
2. **RoPE.** The code rotates the numerator features with a 2-D RoPE (RMT/MLLA style, ``d``
   divisible by 4) and keeps the denominator unrotated; the paper has no RoPE (it names CPE as
   position encoding). Default ``use_rope=True``; ``use_rope=False`` drops it.
3. **Block extras.** LayerNorm then SiLU gate (the paper's "simplified GLA" block, Fig. 2a) and the
   output projection are in both. LePE (5x5 depth-wise conv on ``v``, added before the LayerNorm)
   is in the code only: default ``use_lepe=True``; ``use_lepe=False`` drops it (no ``lepe``
   parameters).
4. **Query power.** Both use the norm-aware ``p = lam * (0.5 + tanh(||q||))`` (Eq. 8). The paper's
   Table 5 ablation rows 1-2 use a constant power instead: ``query_power=c`` gives ``p = c`` for
   every token (``d(q)`` has unit norm, so the query norm cancels again, as in plain linear
   attention). Default ``query_power=None`` (norm-aware).
5. **Zero-norm query.** The code divides by ``||q||`` without an epsilon (NaN for ``q = 0``); here
   the divisor is clamped at ``1e-12`` (``d(0) = 0``: the token's output is its LePE/gate term).

Kernels: the core (feature maps, RoPE, normaliser, the two small GEMMs) runs through
:func:`linattn_mm.ops.nala.nala_attention`, chosen once by ``core``: ``'fast'`` (the torch kernel
of the official kernel with the training Function of :mod:`linattn_mm.ops.nala.autograd`; the
default, for both kernels), ``'reference'`` (plain autograd of the official order of operations and
of the paper's kernel, :mod:`linattn_mm.ops.nala.reference`) or ``'triton'`` (the Triton kernels,
forward and backward, CUDA only).
The inference forms of the whole layer come from :func:`linattn_mm.deploy.convert` (for the official
kernel with LePE and the norm-aware power; other settings keep the training form).

The paper's own form of the mixer, ``kernel='paper', use_rope=False, use_lepe=False``, is::

    out = out_proj(LN(phi_q (phi_k^T v) / N / (phi_q . mean_j(phi_k) + eps)) * SiLU(g))

Precision: everything between the ``qkvg`` projection and ``out_proj`` (LePE, kernel, matmuls,
LayerNorm and gate) runs in float32 with autocast disabled, as the official code's ``.float()``
(``k^3`` and the powers overflow fp16; there, under autocast, the kernel's matmuls would still run
in half precision); float64 inputs are computed in float64. The softmax stages
(:class:`NaLaSoftmaxAttention`) run their attention products under autocast, as the official
block does.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from linattn_mm.ops.common import (autocast_dtype, autocast_on, core_dtype, no_autocast,
                                   promote_types)
from linattn_mm.ops.dispatch import check_core
from linattn_mm.ops.lean_layers import NormGatedLinear, depthwise_conv_tokens, split_linear
from linattn_mm.ops.nala import (KERNELS, RopeTables, apply_rope, core_refusal, nala_attention,
                                 nala_feature_maps, nala_weights_reference, rotate_pairs)
from linattn_mm.registry import ATTENTIONS
from .base import BaseTokenMixer

__all__ = ['RoPE2d', 'apply_rope', 'NaLaMixerBase', 'NormAwareLinearAttention',
           'NaLaSoftmaxAttention', 'GATE_CORES', 'SOFTMAX_CORES', 'set_fused_gates',
           'set_fused_rope']


class RoPE2d(nn.Module):
    """2-D rotary position embedding of the RMT / NaLaFormer code.

    For a head size ``d`` (divisible by 4) it keeps ``angle = 1 / base ** linspace(0, 1, d / 4)``
    with each value repeated twice (``d / 2`` entries). On an ``H x W`` grid the first ``d / 2``
    channels of a token at ``(y, x)`` are rotated pairwise by ``y * angle`` and the last ``d / 2``
    by ``x * angle``; any grid size works.

    Args:
        head_dims (int): channels per head ``d``.
        base (float): frequency base. Defaults to 10000.
        persistent (bool): keep ``angle`` in the state dict (the official hierarchy does, as
            ``layers.{i}.RoPE.angle``). Defaults to True.
    """

    def __init__(self, head_dims, base=10000., persistent=True):
        super().__init__()
        if head_dims % 4:
            raise ValueError(f'RoPE2d needs head_dims divisible by 4, got {head_dims}')
        self.head_dims = head_dims
        angle = 1.0 / (base ** torch.linspace(0, 1, head_dims // 4))
        self.register_buffer('angle', angle.repeat_interleave(2), persistent=persistent)

    def forward(self, hw_shape):
        """Return ``(sin, cos)``, each ``(H * W, d)``, in the dtype of ``angle`` (a
        :class:`~linattn_mm.ops.nala.RopeTables`: the layers that share it make its complex
        tables once)."""
        H, W = hw_shape
        angle = self.angle
        th = torch.arange(H, device=angle.device, dtype=angle.dtype)[:, None] * angle
        tw = torch.arange(W, device=angle.device, dtype=angle.dtype)[:, None] * angle
        theta = torch.cat([th[:, None, :].expand(H, W, -1), tw[None, :, :].expand(H, W, -1)], -1)
        theta = theta.reshape(H * W, -1)
        return RopeTables(theta.sin(), theta.cos())

    def extra_repr(self):
        return f'head_dims={self.head_dims}'


#: ``gate_core`` names of the NaLa mixers' gated output (:meth:`NaLaMixerBase.gated_output`)
GATE_CORES = ('fast', 'fused')
#: ``core`` names of :class:`NaLaSoftmaxAttention`
SOFTMAX_CORES = ('fast', 'reference', 'fused')


class NaLaMixerBase(BaseTokenMixer):
    """Base class of NaLaFormer's two attention mixers: the shared parameters (keys ``qkvg``,
    ``lepe``, ``ln``, ``out_proj``), the projection with the LePE term and the gated output
    ``out_proj(LN(out + LePE(v)) * SiLU(g))``.

    Attribute ``gate_core`` (:data:`GATE_CORES`): the gated output's training form, ``'fast'``
    (default) or ``'fused'`` (its LayerNorm and gate as Triton kernels, CUDA:
    :mod:`linattn_mm.ops.nala.gate_fused`; set by :func:`set_fused_gates`, which
    ``--attn-core fused`` calls). A mixer on ``core='reference'`` runs it step by step."""
    supports_extra_tokens = False
    gate_core = 'fast'

    def _build_common(self, embed_dims, qkv_bias, lepe_kernel_size, proj_drop, use_rope,
                      rope_base, use_lepe=True):
        if lepe_kernel_size % 2 != 1:
            raise ValueError(f'lepe_kernel_size must be odd, got {lepe_kernel_size}')
        if not isinstance(use_lepe, bool):
            raise TypeError(f'{type(self).__name__}: use_lepe must be True or False, '
                            f'got {use_lepe!r}')
        self.qkvg = nn.Linear(embed_dims, embed_dims * 4, bias=qkv_bias)
        self.use_lepe = use_lepe
        # without LePE there is no `lepe` module (and no `lepe.*` state-dict keys)
        self.lepe = nn.Conv2d(embed_dims, embed_dims, lepe_kernel_size, 1, lepe_kernel_size // 2,
                              groups=embed_dims) if self.use_lepe else None
        self.act = nn.SiLU()
        self.ln = nn.LayerNorm(embed_dims)
        self.out_proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)
        self.use_rope = bool(use_rope)
        # own RoPE (non-persistent: no state-dict key) for skeletons that do not pass one
        self.rotary = RoPE2d(self.head_dims, rope_base, persistent=False) if use_rope else None

    def init_weights(self):
        """Official NaLaFormer init of the mixer's own conv and norm (LePE truncated normal with
        std 0.02 and zero bias, LayerNorm ones/zeros); the linear layers keep the host's init
        (the native hierarchy: PyTorch default, as the official code; Swin/PVT skeletons: their
        truncated normal). An ``init_cfg`` replaces this."""
        if self.init_cfg is not None:
            super().init_weights()
            return
        if self.lepe is not None:
            nn.init.trunc_normal_(self.lepe.weight, std=.02)
            if self.lepe.bias is not None:
                nn.init.zeros_(self.lepe.bias)
        nn.init.ones_(self.ln.weight)
        nn.init.zeros_(self.ln.bias)

    def _project(self, x, hw_shape, keep_low=True):
        """Tokens -> q, k (B, h, N, d) and g (B, N, C) in the projection's dtype (half precision
        under autocast: their consumers compute in the core dtype, float32, and the lean forms
        keep these, not float32 copies), v (B, h, N, d) in the core dtype (float32; float64
        stays), LePE(v) (B, N, C; None without LePE) in the core dtype, the LePE conv with
        autocast off, and ``v_low``: v in the projection's dtype where that is lower (else None),
        for the lean forms to keep. v is cast once because it feeds both the LePE and the
        attention, whose gradients are then summed in the core dtype, as in the plain form.
        ``keep_low=False`` (the softmax mixer, whose attention makes its own copies of v): g in
        the core dtype too, no ``v_low``, so that nothing keeps the half-precision projection."""
        B, N, C = x.shape
        h, d = self.num_heads, self.head_dims
        # the training form's backward does not stack the chunks' gradients
        q, k, v, g = split_linear(x, self.qkvg, 4, lean=self.core != 'reference')
        v_low, v = v, v.to(core_dtype(v))
        v_low = None if v_low is v or not keep_low else v_low
        if not keep_low:
            g = g.to(v.dtype)
        lepe = None if self.lepe is None else self._lepe(v, hw_shape, x.device, v_low)
        q, k, v = (t.reshape(B, N, h, d).transpose(1, 2) for t in (q, k, v))
        if v_low is not None:
            v_low = v_low.reshape(B, N, h, d).transpose(1, 2)
        return q, k, v, g, lepe, v_low

    def _lepe(self, v, hw_shape, device, v_low=None):
        """The LePE term of the (B, N, C) values (in the core dtype), the conv with autocast off;
        the lean form keeps ``v_low`` (v in a lower precision, or None) instead of v."""
        with no_autocast(device):
            w = self.lepe.weight.to(v.dtype)
            b = None if self.lepe.bias is None else self.lepe.bias.to(v.dtype)
            return depthwise_conv_tokens(v, hw_shape, w, b, self.lepe.padding,
                                         lean=self.core != 'reference', keep=v_low)

    def _rope(self, hw_shape, rope, dtype, device):
        """``(sin, cos)`` of the RoPE (the stage's shared one, or this mixer's own), or Nones."""
        if not self.use_rope:
            return None, None
        if rope is None:
            rope = self.rotary(hw_shape)
        sin, cos = rope
        return sin.to(device=device, dtype=dtype), cos.to(device=device, dtype=dtype)

    def gated_output(self, out, lepe, g):
        """``out_proj(LN(out + lepe) * SiLU(g))`` (without LePE, ``lepe`` None:
        ``out_proj(LN(out) * SiLU(g))``) of the (B, h, N, d) core output: LN and gate in
        the core dtype with autocast off, ``out_proj`` under the caller's autocast. With
        ``core='reference'`` step by step; otherwise :class:`~linattn_mm.ops.lean_layers.
        NormGatedLinear`, which keeps ``out + lepe`` and ``g`` only for backward, with
        ``gate_core='fused'`` its LayerNorm and gate as one Triton kernel each way
        (:mod:`linattn_mm.ops.nala.gate_fused`)."""
        B, h, N, d = out.shape
        s = out.transpose(1, 2).reshape(B, N, h * d)
        if lepe is not None:
            s = s + lepe
        ln = self.ln
        if self.core != 'reference' and type(self.act) is nn.SiLU:
            if not autocast_on(s.device):
                s, g = s.to(self.out_proj.weight.dtype), g.to(self.out_proj.weight.dtype)
            gated = NormGatedLinear.apply
            if check_core(f'{type(self).__name__} gate', self.gate_core, GATE_CORES) == 'fused':
                from linattn_mm.ops.nala.gate_fused import norm_gated_linear_fused as gated
            return self.proj_drop(gated(
                s, ln.weight.to(s.dtype), ln.bias.to(s.dtype), ln.eps, g, self.out_proj.weight,
                self.out_proj.bias))
        with no_autocast(s.device):
            y = F.layer_norm(s, (h * d, ), ln.weight.to(s.dtype), ln.bias.to(s.dtype), ln.eps)
            y = y * self.act(g.to(y.dtype))
        if not autocast_on(y.device):
            y = y.to(self.out_proj.weight.dtype)
        return self.proj_drop(self.out_proj(y))


@ATTENTIONS.register_module()
class NormAwareLinearAttention(NaLaMixerBase):
    """Norm-aware linear attention (NaLa) of NaLaFormer.

    A global, linear-complexity token mixer on an ``H x W`` grid: the query direction is raised to a
    power that grows with the query norm, ``p = lam * (0.5 + tanh(||q||))``, keys are ``k ** lam``,
    non-negativity comes from a sign split (official code) or from the paper's cos/sin "cosine
    inhibit" map, the numerator is rotated by a 2-D RoPE, and the output goes through
    ``LN(. + LePE(v)) * SiLU(g)`` and ``out_proj``. See the module docstring for the exact formulas
    and the paper-vs-code differences.

    Args:
        embed_dims (int): channels ``C``.
        num_heads (int): heads ``h``; ``C / h`` must be divisible by 4 when ``use_rope``.
        kernel (str): ``'official'`` (ReLU sign split of ``d(q)^p`` and ``k^lam``, the released
            code) or ``'paper'`` (``|d(x)|^p * [cos f(d(x)); sin f(d(x))]`` with
            ``f = pi/4 * tanh``, Eq. 16 and App. A.2). Defaults to ``'official'``.
        power (float): ``lam``, the key power and the scale of the query power. Defaults to 3.
        query_power (float, optional): a constant query power ``p`` instead of the norm-aware
            ``lam * (0.5 + tanh(||q||))`` (the paper's Table 5 ablation rows 1-2). None: the
            norm-aware power (paper and code). Defaults to None.
        use_rope (bool): 2-D RoPE on the numerator features (official; not in the paper).
            Defaults to True.
        rope_base (float): RoPE frequency base. Defaults to 10000.
        use_lepe (bool): the LePE term (official; not in the paper). False builds no ``lepe``
            conv. Defaults to True.
        lepe_kernel_size (int): kernel of the depth-wise LePE conv on ``v``. Defaults to 5.
        eps (float): added to the denominator. Defaults to 1e-6.
        qkv_bias (bool): bias of the ``qkvg`` projection. Defaults to True.
        proj_drop (float): dropout after ``out_proj``. Defaults to 0.
        core (str): the attention core, :func:`linattn_mm.ops.nala.nala_attention`: ``'fast'``
            (default: the training Function, whose backward recomputes the feature maps; equal to
            the reference up to float rounding, gradients included), ``'reference'`` (plain
            autograd of the official order of operations; the test oracle), ``'fused'`` (the fast
            core's products with its elementwise passes as Triton kernels, official kernel, a
            training core for CUDA: :mod:`linattn_mm.ops.nala.fused`) or ``'triton'`` (the
            Triton kernels of the official kernel with their Triton backward, CUDA only:
            ``attn_cfg=dict(..., core='triton')`` trains with them; set by
            :func:`linattn_mm.deploy.convert` for CUDA inference).
        init_cfg (dict, optional): mmengine init config.

    ``forward(x, hw_shape, rope=None)`` takes tokens ``(B, H*W, C)``; ``rope`` optionally passes a
    precomputed ``(sin, cos)`` pair of :class:`RoPE2d` (the native hierarchy shares one per stage).
    """

    def __init__(self, embed_dims, num_heads, kernel='official', power=3., use_rope=True,
                 rope_base=10000., lepe_kernel_size=5, eps=1e-6, qkv_bias=True, proj_drop=0.,
                 core='fast', query_power=None, use_lepe=True, init_cfg=None):
        super().__init__(embed_dims, num_heads, 0, init_cfg)
        name = type(self).__name__
        if kernel not in KERNELS:
            raise ValueError(f'{name}: kernel must be one of {KERNELS}, got {kernel!r}')
        if power <= 0:
            raise ValueError(f'{name}: power must be positive, got {power}')
        if query_power is not None:
            if isinstance(query_power, bool) or not isinstance(query_power, (int, float)) \
                    or not query_power > 0:
                raise ValueError(f'{name}: query_power must be None (the norm-aware power) or a '
                                 f'positive number, got {query_power!r}')
            query_power = float(query_power)
        self.core = check_core(name, core)
        refusal = core_refusal(core, kernel, query_power)
        if refusal:
            raise ValueError(f'{name}: {refusal}')
        self.kernel = kernel
        self.power = float(power)
        self.query_power = query_power
        self.eps = float(eps)
        self._build_common(embed_dims, qkv_bias, lepe_kernel_size, proj_drop, use_rope, rope_base,
                           use_lepe)

    def feature_maps(self, q, k):
        """Non-negative feature maps ``(phi_q, phi_k)``, each ``(..., N, 2d)``, of per-head
        ``q``, ``k`` ``(..., N, d)`` (:func:`linattn_mm.ops.nala.nala_feature_maps`)."""
        return nala_feature_maps(q, k, self.power, self.kernel, self.query_power)

    def forward(self, x, hw_shape, rope=None):
        self.check_input(x, hw_shape)
        q, k, v, g, lepe, v_low = self._project(x, hw_shape)
        # v is in the core dtype; the core's result stays in it, as the LePE and the LN
        sin, cos = self._rope(hw_shape, rope, v.dtype, q.device)
        with no_autocast(x.device):
            out = nala_attention(q, k, v, self.power, self.eps, sin, cos, self.kernel, self.core,
                                 self.query_power, out_dtype=v.dtype, v_keep=v_low)
        return self.gated_output(out, lepe, g)

    has_attention_weights = True

    def attention_weights(self, x, hw_shape, rope=None):
        """(B, h, N, N) weights of the core, ``A_ij = <R phi(q_i), R phi(k_j)> / (N phi(q_i).mean
        phi(k))``: the core output is ``A v``. The RoPE rotation ``R`` is on the numerator only
        (official), so entries can be negative and rows need not sum to 1."""
        self.check_input(x, hw_shape)
        q, k = self._project(x, hw_shape)[:2]
        q, k = q.to(core_dtype(q)), k.to(core_dtype(k))
        sin, cos = self._rope(hw_shape, rope, q.dtype, q.device)
        with no_autocast(x.device):
            weights = nala_weights_reference(q, k, self.power, self.eps, sin, cos, self.kernel,
                                             self.query_power)
        return dict(weights=weights, key_hw=tuple(hw_shape))

    def extra_repr(self):
        return (f'embed_dims={self.embed_dims}, num_heads={self.num_heads}, kernel={self.kernel}, '
                f'power={self.power}, query_power={self.query_power}, use_rope={self.use_rope}, '
                f'use_lepe={self.use_lepe}, core={self.core}')


@ATTENTIONS.register_module()
class NaLaSoftmaxAttention(NaLaMixerBase):
    """Global softmax attention of the released NaLaFormer hierarchy (its stages 3-4).

    Same parameters as :class:`NormAwareLinearAttention` (``qkvg``, ``lepe``, ``ln``,
    ``out_proj``): ``q`` and ``k`` are rotated by the 2-D RoPE, then
    ``out_proj(LN(softmax(q k^T / sqrt(d)) v + LePE(v)) * SiLU(g))``. The attention runs through
    ``F.scaled_dot_product_attention`` under the caller's autocast; memory is ``O(N)`` with the
    fused kernels. Precision as in the official code: it casts q, k, v to float32 (``.float()``)
    and rotates them in float32, and its two matmuls then run in float32 without autocast and in
    half precision under autocast (autocast casts a matmul's inputs, whatever their dtype), with
    the softmax in float32. The fused kernel keeps the logits and the softmax statistics in
    float32 under autocast too. The LePE, the LayerNorm and the gate run in float32, as there.

    Args:
        embed_dims (int): channels ``C``.
        num_heads (int): heads ``h``.
        use_rope (bool): 2-D RoPE on ``q`` and ``k``. Defaults to True.
        rope_base (float): RoPE frequency base. Defaults to 10000.
        use_lepe (bool): the LePE term; False builds no ``lepe`` conv. Defaults to True.
        lepe_kernel_size (int): kernel of the depth-wise LePE conv on ``v``. Defaults to 5.
        qk_scale (float, optional): logit scale; defaults to ``head_dims ** -0.5``.
        attn_drop (float): dropout on the attention weights (training only). Defaults to 0.
        qkv_bias (bool): bias of the ``qkvg`` projection. Defaults to True.
        proj_drop (float): dropout after ``out_proj``. Defaults to 0.
        core (str): ``'fast'`` (default: the gated output through
            :class:`~linattn_mm.ops.lean_layers.NormGatedLinear`), ``'reference'`` (plain
            autograd step by step) or ``'fused'`` (as ``'fast'``, the RoPE of q and k as one
            Triton kernel each way that writes them in the dtype the attention reads,
            :mod:`linattn_mm.ops.nala.rope_fused`, CUDA; set by :func:`set_fused_rope`, which
            ``--attn-core fused`` calls).
        init_cfg (dict, optional): mmengine init config.
    """

    def __init__(self, embed_dims, num_heads, use_rope=True, rope_base=10000., lepe_kernel_size=5,
                 qk_scale=None, attn_drop=0., qkv_bias=True, proj_drop=0., core='fast',
                 use_lepe=True, init_cfg=None):
        super().__init__(embed_dims, num_heads, 0, init_cfg)
        self.core = check_core(type(self).__name__, core, SOFTMAX_CORES)
        self.scale = qk_scale or self.head_dims ** -0.5
        self.attn_drop = attn_drop
        self._build_common(embed_dims, qkv_bias, lepe_kernel_size, proj_drop, use_rope, rope_base,
                           use_lepe)

    def _rotate(self, q, k, hw_shape, rope):
        """q and k rotated by the 2-D RoPE (unchanged without it): the reference formula, or
        (``core='fast'``) the same rotation as complex products of the channel pairs
        (:func:`~linattn_mm.ops.nala.fast.rotate_pairs`, fewer operations under autograd)."""
        if rope is None and self.use_rope:  # this mixer's own tables, for q and k
            rope = self.rotary(hw_shape)
        sin, cos = self._rope(hw_shape, rope, q.dtype, q.device)
        if sin is None:
            return q, k
        if self.core == 'reference':
            return apply_rope(q, sin, cos), apply_rope(k, sin, cos)
        return rotate_pairs(q, sin, cos, rope), rotate_pairs(k, sin, cos, rope)

    has_attention_weights = True

    def attention_weights(self, x, hw_shape, rope=None):
        """(B, h, N, N) softmax weights, in float32 also under autocast (where the forward's
        products run in half precision)."""
        self.check_input(x, hw_shape)
        q, k = self._project(x, hw_shape)[:2]
        with no_autocast(x.device):
            q, k = self._rotate(q.to(core_dtype(q)), k.to(core_dtype(k)), hw_shape, rope)
            weights = (q @ k.transpose(-2, -1) * self.scale).softmax(-1)
        return dict(weights=weights, key_hw=tuple(hw_shape))

    def _rotate_fused(self, q, k, hw_shape, rope, dtype):
        """q and k rotated by the 2-D RoPE in float32 (float64 ones in float64) and written in
        ``dtype`` by one Triton kernel each (:func:`~linattn_mm.ops.nala.rope_fused.
        rope_rotate_fused`), or cast to ``dtype`` without it."""
        from linattn_mm.ops.nala.rope_fused import rope_rotate_fused
        if rope is None and self.use_rope:
            rope = self.rotary(hw_shape)
        sin, cos = self._rope(hw_shape, rope, promote_types(q.dtype, torch.float32), q.device)
        if sin is None:
            return q.to(dtype), k.to(dtype)
        return (rope_rotate_fused(q, sin, cos, dtype, rope),
                rope_rotate_fused(k, sin, cos, dtype, rope))

    def forward(self, x, hw_shape, rope=None):
        self.check_input(x, hw_shape)
        # v cast once, so that the LePE and attention gradients are summed in float32; the LePE
        # keeps that v, the gate a float32 g, the attention its own copies (half precision
        # under autocast)
        q, k, v, g, lepe, _ = self._project(x, hw_shape, keep_low=False)
        if self.core == 'fused':  # the dtype autocast runs the attention in (float64 it leaves
            # as it is), q and k written in it
            low = autocast_dtype(x.device)
            if low is None or v.dtype == torch.float64:
                low = v.dtype
            q, k = self._rotate_fused(q, k, hw_shape, rope, low)
            attn_v = v.to(low)
        else:
            with no_autocast(x.device):  # the RoPE in float32, as the official code
                q, k = self._rotate(q.to(v.dtype), k.to(v.dtype), hw_shape, rope)
            attn_v = v
        # the products under the caller's autocast, as the official code's matmuls: in half
        # precision under autocast (softmax statistics in float32), in float32 otherwise
        out = F.scaled_dot_product_attention(
            q, k, attn_v, dropout_p=self.attn_drop if self.training else 0., scale=self.scale)
        return self.gated_output(out.to(v.dtype), lepe, g)


def set_fused_rope(model, fused):
    """Put every :class:`NaLaSoftmaxAttention` of ``model`` on ``core='fused'`` (``fused`` True:
    the RoPE of q and k as Triton kernels) or from there back to ``'fast'`` (a mixer on
    ``'reference'`` stays there when ``fused`` is False); returns how many are on it."""
    mixers = [m for m in model.modules() if isinstance(m, NaLaSoftmaxAttention)]
    for m in mixers:
        if fused:
            m.core = 'fused'
        elif m.core == 'fused':
            m.core = 'fast'
    return sum(m.core == 'fused' for m in mixers)


def set_fused_gates(model, fused):
    """Put the gated output of every NaLa mixer (:class:`NormAwareLinearAttention`,
    :class:`NaLaSoftmaxAttention`) of ``model`` on ``gate_core='fused'`` (``fused`` True: its
    LayerNorm and gate as Triton kernels) or back to ``'fast'``; returns how many are on it."""
    mixers = [m for m in model.modules() if isinstance(m, NaLaMixerBase)]
    for m in mixers:
        m.gate_core = 'fused' if fused else 'fast'
    return sum(m.gate_core == 'fused' for m in mixers)
