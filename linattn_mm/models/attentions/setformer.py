"""SeT: self-optimal-transport attention (Shamsolmoali et al., *SeTformer is What You Need for
Vision and Language*, AAAI 2024, arXiv 2401.03540).

No official code exists; this is written from the paper text, with every choice the paper leaves
open exposed as an argument (defaults and reasons: ``docs/model_zoo/setformer.md``, "Arguments and
documented choices"). Per head, for tokens x_1..x_n (head slice of d channels) and a
learnable reference set y_1..y_m::

    S_ij   = k(x_i, y_j)                        kernel similarity (cost C = -S)
             Gaussian on L2-normalised vectors: k = exp((<x̂, ŷ> - 1) / sigma²)
             or its Nyström approximation with k anchors z: k_z(x,z) (K_zz + λI)^-1 k_z(z,y)
    logK   = S / eps                            Gibbs kernel
    T      = Sinkhorn(K; rows 1/n, cols 1/m) ⊙ M
                                                entropic OT plan (n×m), log domain, times the
                                                positional term M_ij = exp(-(i/n - j/m)² / tau)
                                                [3] (position='kernel': log M added to logK)
    A      = T Tᵀ / T Tᵀ 1                      [1] self-kernel of Eq. 4 with x' = x: n×n,
                                                non-negative, rows summing to 1 (never formed);
                                                paper Eq. 3: √m · Tᵀ u(x), m rows
    out    = proj( A V ),  V = W_v x            [2] paper: V = u(x) (Eq. 3) or v(x) (Eq. 5);
                                                computed right to left: T (Tᵀ V), O(n·m·d)
    y      learnable parameters                 [4] paper: K-means centroids of training features

Interpretations (the paper's formula each replaces, and the switch for the paper's wording where it
is well defined; [3] follows the paper's wording by default since version 0.6.0):

[1] **n-token output through T·Tᵀ.** Eq. 3 defines the attention output as
    ``A_y(x) = √m · T(x, y)ᵀ u(x)``, an m×d matrix with one row per reference (the pooled output of
    OTK). A backbone block needs n output tokens (the residual ``x + attn(x)`` and the next stage's
    grid), so the output is the n×n self-kernel weighting of Eq. 4 applied to the values:
    ``T_y(x, x) = m · T Tᵀ``, scaled to ``n·m · T Tᵀ`` so that its rows sum to 1 at Sinkhorn
    convergence (the paper's ``m · T Tᵀ`` rows sum to 1/n), and by default divided by its exact row
    sums ``T (Tᵀ 1)`` (``row_normalize``; False uses the constant n·m). No switch: an m-row output
    is not a token mixer.
[2] **Linear values W_v x instead of u(x).** Eq. 3 aggregates the kernel feature map u(x_i), which
    for the Gaussian kernel is infinite-dimensional; the default values are ``W_v x`` (one
    Linear(C, C); with the output projection about 2C² per block, which reproduces the paper's M / T
    parameter counts). ``values='nystrom'`` (with ``kernel='nystrom'``) aggregates the paper's
    finite embedding of Eq. 5, ``v(x_i) = κ(z, z)^-1/2 κ(z, x_i)`` (k = ``num_anchors`` channels
    per head, symmetric inverse square root), with no value projection and an output projection
    Linear(h·k, C); the cost is then ``<v(x_i), v(y_j)>``, the Nyström kernel of the default path.
[3] **Positional term before Sinkhorn.** The paper multiplies ``T(v(x), y)`` by M ("performing a
    multiplication of T with a distance matrix M", element-wise: both are n×m) and puts the result
    into Eq. 5, i.e. after Sinkhorn: the default, ``position='plan'`` (the plan's marginals are
    then lost and only the row normalisation keeps the attention rows at 1). ``position='kernel'``
    (the default before version 0.6.0) multiplies the Gibbs kernel before Sinkhorn instead, a cost
    term, so the plan keeps its marginals (as OTK's first use of its position filter); ``'both'``
    is OTK's.
[4] **Learnable references.** The paper's y are "the centroids obtained by conducting K-means
    clustering to feature vectors in the training set". By default the references are learnable
    parameters (in the state dict and the parameter count); ``refs_learnable=False`` makes them
    buffers set only by :meth:`SeTAttention.kmeans_init_` (spherical K-means of a batch of block
    inputs), the paper's wording; that mode has no training-time hook: call ``kmeans_init_`` on
    each block's inputs before training.

Cost per head: O(n·m·(d + L)) time for L Sinkhorn iterations and O(n·m) memory; no n×n tensor is
ever formed. The unrolled Sinkhorn loop is differentiated exactly and stores no per-iteration n×m
tensor, so training memory does not grow with L either: in the log domain (``core='reference'``)
through a custom log-sum-exp step whose backward recomputes each step's soft-max from the shared
log-kernel; in the scaling domain (``core='fast'``, Gaussian kernel: ``u = a / (K v)``,
``v = b / (Kᵀ u)`` with ``K = exp(logK - max)``, the same potentials) through an autograd Function
that keeps the loop's vectors and recomputes the n×m maps in its backward
(:mod:`linattn_mm.ops.setformer.autograd`).

Kernel maths lives in plain functions in :mod:`linattn_mm.ops.setformer`
(:func:`gaussian_kernel`, :func:`nystrom_similarity`, :func:`nystrom_inv_sqrt`,
:func:`nystrom_embedding`, :func:`positional_log_kernel`,
:func:`log_sinkhorn`, :func:`transport_plan`, :func:`self_transport_attention`,
:func:`spherical_kmeans`, re-exported here) so they can be tested alone;
:class:`SeTAttention` wires them together.
"""
import math

import torch
import torch.nn as nn

from linattn_mm.ops.dispatch import check_core
from linattn_mm.ops.lean_layers import recomputed
from linattn_mm.ops.setformer import (gaussian_kernel, log_sinkhorn, nystrom_embedding,
                                      nystrom_inv_sqrt, nystrom_similarity, positional_log_kernel,
                                      self_transport_attention, spherical_kmeans, transport_plan)
from linattn_mm.ops.setformer.autograd import (MAX_LOG_RANGE, scaling_sinkhorn,
                                               self_transport_attention_fast)
from linattn_mm.registry import ATTENTIONS
from .base import BaseTokenMixer, merge_heads, run_in_fp32, split_heads

__all__ = [
    'SeTAttention', 'gaussian_kernel', 'nystrom_similarity', 'nystrom_inv_sqrt',
    'nystrom_embedding', 'positional_log_kernel',
    'log_sinkhorn', 'transport_plan', 'self_transport_attention', 'spherical_kmeans',
    'setformer_cost', 'resize_refs'
]


# -------------------------------------------------------------------------------------------------
# analytic counts and checkpoint reuse
# -------------------------------------------------------------------------------------------------
def setformer_cost(num_tokens, embed_dims, num_heads, num_refs, num_iters, kernel='gaussian',
                   num_anchors=64, cost_features='x', values='linear'):
    """Analytic multiply-accumulate count of one :class:`SeTAttention` forward (exp / log /
    elementwise ops counted as 0 MACs, like fvcore).

    Returns:
        dict: ``linear`` (projections), ``similarity`` (n·m·C, or the Nyström products),
        ``aggregate`` (T(Tᵀ[V,1]): 2·n·m·(d+1) per head, d = k for ``values='nystrom'``),
        ``sinkhorn_elements`` (n·m·h·2L element evaluations of the loop, not MACs: log-sum-exp
        terms in the log domain, multiply-adds of matrix-vector products in the scaling form) and
        ``total`` (MACs). ``values='nystrom'``: no value projection, the output projection is
        Linear(h·k, C), and the similarity is the product of the embeddings (the inverse square
        root's product U Λ^-1/2 Uᵀ is k³ MACs; the eigendecomposition is not a matmul).
    """
    n, C, h, m = num_tokens, embed_dims, num_heads, num_refs
    d = C // h
    k = num_anchors
    linear = (3 if cost_features == 'key' else 2) * n * C * C
    if values == 'nystrom':
        linear = (n * C * C if cost_features == 'key' else 0) + n * h * k * C
    if kernel == 'gaussian':
        sim = n * m * C
    elif values == 'nystrom':
        sim = h * (n * k * d + m * k * d + k * k * d + k ** 3 + (n + m) * k * k + n * m * k)
    else:
        sim = h * (n * k * d + m * k * d + k * k * d + k ** 3 // 3 + (n + m) * k * k + n * m * k)
    aggregate = 2 * h * n * m * ((k if values == 'nystrom' else d) + 1)
    return dict(linear=linear, similarity=sim, aggregate=aggregate,
                sinkhorn_elements=2 * num_iters * h * n * m, total=linear + sim + aggregate)


def resize_refs(src, num_refs, generator=None):
    """Adapt a reference set (h, m_src, d) to ``num_refs`` references (checkpoint reuse across the
    paper's m = 500 / 750 / 800): fewer -> spherical K-means of the source references (seeded by
    ``generator``); more -> all source references plus copies of them (cyclic) perturbed by
    Gaussian noise of 1/10 of their RMS norm (deterministic with ``generator``)."""
    h, m_src, d = src.shape
    if num_refs == m_src:
        return src.clone()
    if num_refs < m_src:
        cent, _ = spherical_kmeans(src, num_refs, generator=generator)
        scale = src.float().norm(dim=-1).mean(-1)[:, None, None]
        return (cent * scale).to(src.dtype)
    extra = num_refs - m_src
    idx = torch.arange(extra) % m_src
    base = src[:, idx].float()
    rms = src.float().norm(dim=-1).pow(2).mean().sqrt() / math.sqrt(d)
    noise = torch.randn(base.shape, generator=generator) * 0.1 * rms
    return torch.cat([src.float(), base + noise.to(base.device)], 1).to(src.dtype)


# -------------------------------------------------------------------------------------------------
# the module
# -------------------------------------------------------------------------------------------------
@ATTENTIONS.register_module()
class SeTAttention(BaseTokenMixer):
    """Self-optimal-transport attention (SeT), global (not windowed), multi-head.

    Args:
        embed_dims (int): channels C.
        num_heads (int): heads h (d = C / h channels each).
        num_refs (int): references m per head. Default 500 (paper, ImageNet; 750 COCO, 800 ADE20K).
        eps (float): entropic regularisation ε. Default 0.1 (ImageNet; 0.3 COCO / ADE20K).
        num_iters (int): Sinkhorn iterations L (row + column update each). Default 30: at the
            defaults the row marginals are then within 1e-4 (the columns are exact, the loop ends
            with the column update) for the sharpest plans met in the tests (tokens clustered
            around the references), see ``tests/models/test_setformer.py``. The paper gives no value
            (OTK: 10-100).
        tau (float, optional): positional bandwidth τ of ``M_ij = exp(-(i/n - j/m)²/τ)``. Default
            0.5 (ImageNet; 0.8 COCO / ADE20K). ``None`` disables the positional term.
        position (str): where M enters: ``'plan'`` (default: multiplies the plan after Sinkhorn
            element-wise, the paper's wording, [3] in the module docstring), ``'kernel'``
            (multiplies the Gibbs kernel before Sinkhorn, i.e. a cost term, the plan keeps its
            marginals; the default before version 0.6.0), ``'both'`` (OTK).
        kernel (str): ``'gaussian'`` (default: exact κ(t) = exp((t-1)/σ²) on L2-normalised head
            features and references) or ``'nystrom'`` (Nyström approximation through
            ``num_anchors`` learnable anchors, paper Eq. 5).
        sigma (float): Gaussian bandwidth σ. Default 0.5 (OTK / CKN default); κ ∈ [e^-8, 1].
        num_anchors (int): Nyström anchors k (``kernel='nystrom'``). Default 64.
        nystrom_reg (float): ridge λ added to κ(ZZᵀ) before its factorisation. Default 1e-3.
        cost_features (str): features compared with the references: ``'x'`` (default: the head
            slice of the input tokens; no extra parameter) or ``'key'`` (a W_k Linear(C, C) first).
        row_normalize (bool): divide the output by the row sums of T Tᵀ (computed right to left),
            so the attention rows sum to 1 exactly. Default True. False: the constant
            ``n_valid·m`` (exact only at Sinkhorn convergence, and not with ``position='plan'``).
        refs_learnable (bool): references (and anchors) are ``nn.Parameter`` (default True) or
            buffers set only by :meth:`kmeans_init_` (the paper's "K-means centroids", [4] in the
            module docstring; their count is then not in the parameter count).
        qkv_bias (bool): bias of the value (and key) projections. Default True.
        proj_drop (float): dropout after the output projection. Default 0.
        fp32 (bool): under autocast, run the whole mixer in float32 with autocast disabled (output
            float32). Default True.
        num_extra_tokens (int): class tokens before the grid (transported like grid tokens, no
            positional term). Default 0.
        values (str): the vectors aggregated by T Tᵀ (see [2] in the module docstring):
            ``'linear'`` (default: ``W_v x``, a Linear(C, C) ``v``) or ``'nystrom'`` (the paper's
            Eq. 5 embedding ``v(x) = κ(z, z)^-1/2 κ(z, x)`` of the cost features, k =
            ``num_anchors`` per head; needs ``kernel='nystrom'``; no ``v``, ``proj`` is
            Linear(h·k, C)).
        core (str): ``'fast'`` (default) or ``'reference'`` (plain autograd through the
            log-domain loop). ``'fast'`` with the Gaussian kernel, whose :attr:`log_kernel_range`
            is at most ``MAX_LOG_RANGE`` = 30: the core from the normalised features on is one
            autograd Function with Sinkhorn in the scaling domain
            (:func:`linattn_mm.ops.setformer.autograd.self_transport_attention_fast`), keeping
            the features, references, values and the loop's vectors; otherwise the mixer keeps
            only its input and runs once more in the backward
            (:func:`linattn_mm.ops.lean_layers.recomputed`). The same outputs and gradients
            (with ``fp32=False`` under autocast the fast core still runs in float32, the
            reference in the autocast dtype).
        init_cfg (dict, optional): mmengine init config.

    Parameters: ``v`` Linear(C, C), ``proj`` Linear(C, C), ``refs`` (h, m, d) (+ ``k`` Linear(C, C)
    for ``cost_features='key'``, ``anchors`` (h, k, d) for Nyström; ``values='nystrom'``: no ``v``,
    ``proj`` Linear(h·k, C)). ``forward(x, hw_shape,
    key_padding_mask=None)``: ``key_padding_mask`` (B, N) bool, True = padded token (row marginal
    0, valid rows 1/n_valid; padded outputs are 0).
    """
    POSITIONS = ('kernel', 'plan', 'both')
    KERNELS = ('gaussian', 'nystrom')
    COST_FEATURES = ('x', 'key')
    VALUES = ('linear', 'nystrom')

    def __init__(self, embed_dims, num_heads, num_refs=500, eps=0.1, num_iters=30, tau=0.5,
                 position='plan', kernel='gaussian', sigma=0.5, num_anchors=64,
                 nystrom_reg=1e-3, cost_features='x', row_normalize=True, refs_learnable=True,
                 qkv_bias=True, proj_drop=0., fp32=True, num_extra_tokens=0, core='fast',
                 values='linear', init_cfg=None):
        super().__init__(embed_dims, num_heads, num_extra_tokens=num_extra_tokens,
                         init_cfg=init_cfg)
        name = type(self).__name__
        if not (isinstance(num_refs, int) and num_refs >= 1):
            raise ValueError(f'{name}: num_refs must be a positive int, got {num_refs!r}')
        if not eps > 0:
            raise ValueError(f'{name}: eps must be > 0, got {eps!r}')
        if not (isinstance(num_iters, int) and num_iters >= 1):
            raise ValueError(f'{name}: num_iters must be an int >= 1, got {num_iters!r}')
        if tau is not None and not tau > 0:
            raise ValueError(f'{name}: tau must be > 0 or None, got {tau!r}')
        if position not in self.POSITIONS:
            raise ValueError(f'{name}: position must be one of {self.POSITIONS}, got {position!r}')
        if kernel not in self.KERNELS:
            raise ValueError(f'{name}: kernel must be one of {self.KERNELS}, got {kernel!r}')
        if not sigma > 0:
            raise ValueError(f'{name}: sigma must be > 0, got {sigma!r}')
        if kernel == 'nystrom' and not (isinstance(num_anchors, int) and num_anchors >= 1):
            raise ValueError(f'{name}: num_anchors must be a positive int, got {num_anchors!r}')
        if cost_features not in self.COST_FEATURES:
            raise ValueError(f'{name}: cost_features must be one of {self.COST_FEATURES}, '
                             f'got {cost_features!r}')
        if values not in self.VALUES:
            raise ValueError(f'{name}: values must be one of {self.VALUES}, got {values!r}')
        if values == 'nystrom' and kernel != 'nystrom':
            raise ValueError(f"{name}: values='nystrom' (the paper's Nyström embedding v(x) as "
                             f"values) needs kernel='nystrom', got kernel={kernel!r} (the "
                             f'Gaussian feature map u(x) is infinite-dimensional)')
        self.core = check_core(name, core, ('fast', 'reference'))
        C, h, d = embed_dims, num_heads, self.head_dims
        self.num_refs = num_refs
        self.eps = float(eps)
        self.num_iters = num_iters
        self.tau = tau
        self.position = position
        self.kernel = kernel
        self.sigma = float(sigma)
        self.num_anchors = num_anchors if kernel == 'nystrom' else None
        self.nystrom_reg = float(nystrom_reg)
        self.cost_features = cost_features
        self.row_normalize = row_normalize
        self.refs_learnable = refs_learnable
        self.fp32 = fp32
        self.values = values
        self.v = nn.Linear(C, C, bias=qkv_bias) if values == 'linear' else None
        self.k = nn.Linear(C, C, bias=qkv_bias) if cost_features == 'key' else None
        self.proj = nn.Linear(C if values == 'linear' else h * num_anchors, C)
        self.proj_drop = nn.Dropout(proj_drop)
        self._add_set('refs', torch.randn(h, num_refs, d))
        if kernel == 'nystrom':
            self._add_set('anchors', torch.randn(h, num_anchors, d))

    def _add_set(self, name, value):
        if self.refs_learnable:
            self.register_parameter(name, nn.Parameter(value))
        else:
            self.register_buffer(name, value)

    @property
    def log_kernel_range(self):
        """An upper bound of max - min of the log Gibbs kernel over each (batch, head) slice, or
        None where there is none: the Gaussian kernel lies in ``(0, 1]``, so ``S / eps`` spans
        less than ``1 / eps``, plus ``1 / tau`` with the positional term in the kernel; the
        Nyström approximation is not bounded."""
        if self.kernel != 'gaussian':
            return None
        pos = 1. / self.tau if self.tau is not None and self.position in ('kernel', 'both') else 0.
        return 1. / self.eps + pos

    @property
    def sinkhorn(self):
        """The Sinkhorn loop of :attr:`core`: the scaling-domain form for ``'fast'`` when
        :attr:`log_kernel_range` allows it, else the log-domain one (the same potentials)."""
        bound = self.log_kernel_range
        if self.core == 'fast' and bound is not None and bound <= MAX_LOG_RANGE:
            return scaling_sinkhorn
        return log_sinkhorn

    # --- pieces --------------------------------------------------------------------------------
    def cost_inputs(self, x):
        """Per-head L2-normalised features compared with the references, (B, h, N, d)."""
        feats = self.k(x) if self.k is not None else x
        return nn.functional.normalize(split_heads(feats, self.num_heads), dim=-1)

    def similarity(self, feats):
        """Kernel similarity S (B, h, N, m) of normalised features and references."""
        refs = nn.functional.normalize(self.refs, dim=-1)
        if self.kernel == 'gaussian':
            return gaussian_kernel(feats @ refs.transpose(-1, -2), self.sigma)
        anchors = nn.functional.normalize(self.anchors, dim=-1)
        return nystrom_similarity(feats, refs, anchors, self.sigma, self.nystrom_reg)

    def nystrom_values(self, feats):
        """``values='nystrom'``: the paper's embeddings (Eq. 5) of the cost features and of the
        references, ``v(x̂)`` (B, h, N, k) and ``v(ŷ)`` (h, m, k), :func:`nystrom_embedding`."""
        anchors = nn.functional.normalize(self.anchors, dim=-1)
        refs = nn.functional.normalize(self.refs, dim=-1)
        inv_sqrt = nystrom_inv_sqrt(anchors, self.sigma, self.nystrom_reg)
        return (nystrom_embedding(feats, anchors, self.sigma, inv_sqrt=inv_sqrt),
                nystrom_embedding(refs, anchors, self.sigma, inv_sqrt=inv_sqrt))

    def _marginals(self, x, key_padding_mask):
        B, N = x.shape[0], x.shape[-2]
        m = self.num_refs
        col = x.new_full((1, 1, 1), -math.log(m))
        if key_padding_mask is None:
            return x.new_full((1, 1, 1), -math.log(N)), col, None, float(N)
        if key_padding_mask.shape != (B, N):
            raise ValueError(f'{type(self).__name__}: key_padding_mask must have shape '
                             f'({B}, {N}), got {tuple(key_padding_mask.shape)}')
        pad = key_padding_mask.bool()
        # a sample with no valid token is transported unmasked and its outputs zeroed
        pad_ot = pad & ~pad.all(-1, keepdim=True)
        n_valid = (~pad_ot).sum(-1).to(x.dtype)  # (B,)
        row = (-n_valid.log())[:, None].expand(B, N).masked_fill(pad_ot, float('-inf'))
        return row[:, None], col, ~pad, n_valid[:, None, None, None]

    def _plan(self, x, hw_shape, key_padding_mask=None):
        """(plan T (B, h, N, m), valid mask (B, 1, N, 1) or None, n_valid, the Nyström
        embeddings v(x) (B, h, N, k) used as values for ``values='nystrom'``, else None)."""
        feats = self.cost_inputs(x)
        emb = None
        if self.values == 'nystrom':  # S = <v(x), v(y)>: the Nyström kernel, from the values
            emb, emb_refs = self.nystrom_values(feats)
            S = emb @ emb_refs.transpose(-1, -2)
        else:
            S = self.similarity(feats)
        log_k = S / self.eps
        log_m = None
        if self.tau is not None:
            log_m = positional_log_kernel(hw_shape, self.num_refs, self.tau,
                                          self.num_extra_tokens, x.device, log_k.dtype)
            if self.position in ('kernel', 'both'):
                log_k = log_k + log_m
        row, col, valid, n_valid = self._marginals(log_k, key_padding_mask)  # log_k: (B,h,N,m)
        f, g = self.sinkhorn(log_k, row, col, self.num_iters)
        extra = log_m if self.position in ('plan', 'both') else None
        plan = transport_plan(log_k, f, g, extra)
        if valid is not None:
            valid = valid[:, None, :, None]
        return plan, valid, n_valid, emb

    def transport_plan(self, x, hw_shape, key_padding_mask=None):
        """The transport plans T (B, h, N, m) of tokens ``x`` (for analysis and tests; float32
        under autocast when ``fp32``)."""
        self.check_input(x, hw_shape)
        return run_in_fp32(lambda t, *a: self._plan(t, *a)[0], x, hw_shape, key_padding_mask,
                           enabled=self.fp32)

    has_attention_weights = True

    def attention_weights(self, x, hw_shape):
        """The self-kernel attention ``A = T Tᵀ`` (B, h, N, N) of the transport plan, divided by
        its row sums (``row_normalize``) or scaled by ``N·m``: the output is ``proj(A v)``."""
        plan = self.transport_plan(x, hw_shape)
        a = plan @ plan.transpose(-1, -2)
        if self.row_normalize:
            a = a / a.sum(-1, keepdim=True)
        else:
            a = a * (x.shape[1] * self.num_refs)
        return dict(weights=a, key_hw=tuple(hw_shape))

    # --- forward -------------------------------------------------------------------------------
    def forward(self, x, hw_shape, key_padding_mask=None):
        """Args: x (Tensor): (B, N, C), N = num_extra_tokens + H*W; hw_shape: (H, W);
        key_padding_mask (Tensor, optional): (B, N) bool, True = padded.

        Returns: Tensor (B, N, C) (float32 under autocast when ``fp32``)."""
        self.check_input(x, hw_shape)
        if self.core == 'fast':
            if self.sinkhorn is scaling_sinkhorn and self.values == 'linear':
                return run_in_fp32(self._forward_fast, x, hw_shape, key_padding_mask,
                                   enabled=self.fp32)
            return recomputed(self._mix, x, tuple(hw_shape), key_padding_mask)
        return self._mix(x, hw_shape, key_padding_mask)

    def _forward_fast(self, x, hw_shape, key_padding_mask):
        """``_forward`` with the core from the normalised features on in one Function
        (:func:`~linattn_mm.ops.setformer.autograd.self_transport_attention_fast`: Gaussian
        kernel, scaling-domain Sinkhorn; the same output and gradients)."""
        feats = self.cost_inputs(x)
        refs = nn.functional.normalize(self.refs, dim=-1)
        v = split_heads(self.v(x), self.num_heads).to(feats.dtype)
        row, col, valid, n_valid = self._marginals(feats, key_padding_mask)
        log_m = None
        if self.tau is not None:
            shape, m, tau, extra, device = (tuple(hw_shape), self.num_refs, self.tau,
                                            self.num_extra_tokens, x.device)

            def log_m(dtype):
                return positional_log_kernel(shape, m, tau, extra, device, dtype)
        if valid is not None:
            valid = valid[:, None, :, None]
        out = self_transport_attention_fast(
            feats, refs.to(feats.dtype), v, row, col, valid, n_valid * self.num_refs, self.sigma,
            self.eps, self.num_iters, self.row_normalize, log_m, self.position)
        return self.proj_drop(self.proj(merge_heads(out).to(x.dtype)))

    def _mix(self, x, hw_shape, key_padding_mask):
        return run_in_fp32(self._forward, x, hw_shape, key_padding_mask, enabled=self.fp32)

    def _forward(self, x, hw_shape, key_padding_mask):
        plan, valid, n_valid, emb = self._plan(x, hw_shape, key_padding_mask)
        v = emb if emb is not None else split_heads(self.v(x), self.num_heads).to(plan.dtype)
        out = self_transport_attention(plan, v, self.row_normalize,
                                       scale=n_valid * self.num_refs, valid=valid)
        return self.proj_drop(self.proj(merge_heads(out).to(x.dtype)))

    # --- K-means initialisation ----------------------------------------------------------------
    @torch.no_grad()
    def kmeans_init_(self, features, num_iters=20, generator=None):
        """Initialise ``refs`` (and Nyström ``anchors``) per head by spherical K-means of the
        cost features of a batch of tokens (the paper's "K-means centroids of training
        features").

        Args:
            features (Tensor): (B, N, C) tokens as this module receives them (e.g. the normalised
                block input), all rows used (B·N >= num_refs).
            num_iters (int): Lloyd iterations. Default 20.
            generator (torch.Generator, optional): seeds the initial centroids (deterministic).

        Returns:
            Tensor: the final within-cluster cosine cost per head (h,).
        """
        if features.dim() != 3 or features.shape[-1] != self.embed_dims:
            raise ValueError(f'{type(self).__name__}.kmeans_init_: features must be (B, N, '
                             f'{self.embed_dims}), got {tuple(features.shape)}')
        feats = self.cost_inputs(features.to(self.refs.dtype))  # (B, h, N, d)
        pts = feats.transpose(0, 1).reshape(self.num_heads, -1, self.head_dims)
        cent, cost = spherical_kmeans(pts, self.num_refs, num_iters, generator)
        self.refs.copy_(cent.to(self.refs))
        if self.kernel == 'nystrom':
            anc, _ = spherical_kmeans(pts, self.num_anchors, num_iters, generator)
            self.anchors.copy_(anc.to(self.anchors))
        return cost

    def resize_checkpoint_tensor(self, name, src):
        """Checkpoints at another m (ImageNet m=500 -> COCO 750 / ADE 800): ``refs`` adapted with
        :func:`resize_refs` (seeded, deterministic) instead of failing on the shape mismatch.
        Other names: not resized."""
        if name != 'refs':
            return None
        from linattn_mm.checkpoint import CheckpointError
        dst_shape = self.refs.shape
        if src.dim() != 3 or src.shape[0] != dst_shape[0] or src.shape[2] != dst_shape[2]:
            raise CheckpointError(f"'{name}': SeT references {tuple(src.shape)} cannot become "
                                  f'{tuple(dst_shape)} (heads and head dims must match)')
        gen = torch.Generator().manual_seed(0)
        out = resize_refs(src, dst_shape[1], generator=gen)
        how = 'spherical K-means of the source references' if dst_shape[1] < src.shape[1] else \
            'source references plus perturbed copies'
        return out, f'SeT references {src.shape[1]} -> {dst_shape[1]} ({how})'

    def extra_repr(self):
        return (f'num_refs={self.num_refs}, eps={self.eps}, num_iters={self.num_iters}, '
                f'tau={self.tau}, position={self.position!r}, kernel={self.kernel!r}, '
                f'sigma={self.sigma}, cost_features={self.cost_features!r}, '
                f'values={self.values!r}')

