"""Inference forms of the token mixers.

CPU (float32 / float64):

* :class:`PolaLinearAttentionCPU` — the whole Pola layer chunk by chunk
  (:func:`linattn_mm.ops.pola.chunked_cpu.polarity_layer_chunked`), the exponent, the temperature
  and the resized position encoding kept between calls;
* :class:`NormAwareLinearAttentionCPU` — the whole NaLa layer chunk by chunk
  (:func:`linattn_mm.ops.nala.chunked_cpu.nala_layer_chunked`);
* :class:`WindowSoftmaxAttentionCPU` — Swin window attention a few thousand tokens of windows at a
  time (``qkv``, attention with each window's bias, ``proj``), instead of the whole (B·nW, n, 3C)
  projection and a bias repeated for every window.

CUDA: :class:`PolaLinearAttentionTriton`, :class:`NormAwareLinearAttentionTriton` — the Triton
cores; should a Triton call fail (compiler, driver), a warning names the error and the module runs
its torch kernel from then on.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from linattn_mm.models.attentions.nala import NormAwareLinearAttention
from linattn_mm.models.attentions.pola import PolaLinearAttention
from linattn_mm.models.attentions.softmax import WindowSoftmaxAttention, shift_window_mask
from linattn_mm.ops.common import linear_into
from linattn_mm.ops.dispatch import note_triton_failure, triton_available
from linattn_mm.ops.nala.chunked_cpu import nala_layer_chunked
from linattn_mm.ops.pola.chunked_cpu import polarity_layer_chunked
from .common import InferenceForm

__all__ = ['PolaLinearAttentionCPU', 'NormAwareLinearAttentionCPU', 'WindowSoftmaxAttentionCPU',
           'PolaLinearAttentionTriton', 'NormAwareLinearAttentionTriton',
           'WINDOW_GROUP_TOKENS']

#: tokens of windows per group in :class:`WindowSoftmaxAttentionCPU`
WINDOW_GROUP_TOKENS = 4096


class PolaLinearAttentionCPU(InferenceForm, PolaLinearAttention):
    """The Pola layer in CPU inference, a few thousand tokens at a time: the (N, 4C) projection
    and the feature-sized tensors are never made whole (see
    :func:`~linattn_mm.ops.pola.chunked_cpu.polarity_layer_chunked`)."""
    base_class = PolaLinearAttention
    same_dtype = True

    @classmethod
    def unsupported(cls, module):
        if module.gate_type != 'dynamic':
            return f"the chunked layer has the dynamic gate only (gate='{module.gate_type}')"
        if module.num_extra_tokens:
            return 'the chunked layer takes no class tokens'
        if module.la_sr_ratio != 1:
            return 'the chunked layer has no spatial reduction (la_sr_ratio > 1)'
        if module.head_dims % 2:
            return f'the chunked layer needs an even head dim, got {module.head_dims}'
        return None

    def _coefficients(self, dtype):
        """``p`` (C, ) and ``1 / softplus(scale)`` (C, ) or None, in ``dtype``."""
        params = [self.power] + ([self.scale] if self.temperature else [])

        def compute():
            C = self.embed_dims
            s = self.temperature_per_head()
            return (self.exponent().to(dtype).reshape(C),
                    None if s is None else (1 / s.to(dtype)).reshape(C))
        return self.cached('coefficients', params, compute, (dtype, ))

    def forward(self, x, hw_shape):
        self.check_input(x, hw_shape)
        self.check_inference(x)
        hw_shape = tuple(hw_shape)
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
        pe = None
        if self.use_pos_enc:
            pe = self.cached('pos_enc', [self.positional_encoding],
                             lambda: self.pos_enc(hw_shape).reshape(-1, C), (hw_shape, ))
        out = polarity_layer_chunked(
            x, w_q, b_q, w_kv, b_kv, w_g, b_g, self.proj.weight, self.proj.bias, p, inv_s, pe,
            self.eps, self.num_heads,
            (lambda v: self.conv_term(v, hw_shape)) if self.use_dwc else None)
        return self.proj_drop(out)


class NormAwareLinearAttentionCPU(InferenceForm, NormAwareLinearAttention):
    """The NaLa layer (official kernel) in CPU inference, a few thousand tokens at a time (see
    :func:`~linattn_mm.ops.nala.chunked_cpu.nala_layer_chunked`)."""
    base_class = NormAwareLinearAttention
    same_dtype = True

    @classmethod
    def unsupported(cls, module):
        if module.kernel != 'official':
            return f"the chunked layer runs the official kernel (kernel='{module.kernel}')"
        if module.query_power is not None or module.lepe is None:
            return 'the chunked layer runs the norm-aware power with LePE'
        if type(module.act) is not nn.SiLU:
            return 'the chunked layer needs the SiLU gate'
        return None

    def forward(self, x, hw_shape, rope=None):
        self.check_input(x, hw_shape)
        self.check_inference(x)
        B, N, C = x.shape
        H, W = hw_shape
        w, b = self.qkvg.weight, self.qkvg.bias
        bq, bkv, bg = (None, ) * 3 if b is None else (b[:C], b[C:3 * C], b[3 * C:])
        sin, cos = self._rope(hw_shape, rope, x.dtype, x.device)

        def lepe(v):  # (B, N, C) is channels-last NCHW as it is: no copy on either side
            out = F.conv2d(v.view(B, H, W, C).permute(0, 3, 1, 2), self.lepe.weight,
                           self.lepe.bias, 1, self.lepe.padding, 1, C)
            return out.flatten(2).transpose(1, 2)
        out = nala_layer_chunked(
            x, w[:C], bq, w[C:3 * C], bkv, w[3 * C:], bg, lepe, self.ln.weight, self.ln.bias,
            self.ln.eps, self.out_proj.weight, self.out_proj.bias, self.power, self.eps, sin, cos,
            self.num_heads)
        return self.proj_drop(out)


class WindowSoftmaxAttentionCPU(InferenceForm, WindowSoftmaxAttention):
    """Swin window attention in CPU inference, :data:`WINDOW_GROUP_TOKENS` tokens of windows at a
    time: ``qkv``, attention with each window's bias (relative position bias plus, for shifted
    windows, the mask of the window's position) and ``proj`` of one group while it is in cache,
    written into one output buffer. Same operations per window as the plain form."""
    base_class = WindowSoftmaxAttention
    same_dtype = True

    def forward(self, x, hw_shape):
        self.check_input(x, hw_shape)
        self.check_inference(x)
        B, N, C = x.shape
        ws, h, d = self.window_size, self.num_heads, self.head_dims
        s, Hp, Wp = self._geometry(hw_shape)
        windows = self._window_tokens(x, hw_shape)  # (B*nW, n, C)
        num, n = windows.shape[:2]
        bias = self.relative_position_bias().to(x.dtype)[None]  # (1, h, n, n)
        mask = shift_window_mask(Hp, Wp, ws, s, x.device, x.dtype) if s else None
        nW = num // B
        out = torch.empty_like(windows)
        group = max(1, WINDOW_GROUP_TOKENS // n)
        for g0 in range(0, num, group):
            m = min(group, num - g0)
            qkv = F.linear(windows[g0:g0 + m].reshape(m * n, C), self.qkv.weight, self.qkv.bias)
            q, k, v = qkv.view(m, n, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)  # (m, h, n, d)
            attn_bias = bias
            if mask is not None:  # window g has the mask of its position g % nW in the image
                idx = torch.arange(g0, g0 + m, device=x.device) % nW
                attn_bias = bias + mask[idx][:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, scale=self.scale)
            linear_into(o.transpose(1, 2).reshape(m * n, C), self.proj.weight, self.proj.bias,
                        out[g0:g0 + m].view(m * n, C))
        return self.unwindow(self.proj_drop(out), hw_shape)


class _TritonCore(InferenceForm):
    """CUDA inference with the mixer's Triton core; a failing Triton call (compiler, driver) is
    noted once (:func:`linattn_mm.ops.dispatch.note_triton_failure`) and the torch kernel runs
    from then on."""
    device_type = 'cuda'
    autocast_ok = True
    #: the largest head dim given the Triton core. Measured on an H200 (docs/benchmarks.md,
    #: bf16 inference at 800×1344, batch 8, against the unconverted torch core): faster at d = 32
    #: (Pola-Swin-T 1.36×), slower at d = 64 (Pola-PVT-T 0.65×, NaLaFormer-T 0.91×; a training
    #: step of the Pola core alone 0.42× of the reference; its d × d products, float32 FMA
    #: loops, are four times those of d = 32). Mixers with larger heads keep the torch core;
    #: raise this (on the class) to convert them all the same.
    max_head_dims = 32

    @classmethod
    def unsupported(cls, module):
        if module.head_dims > cls.max_head_dims:
            return (f'head dims {module.head_dims} > {cls.max_head_dims}: the torch core is '
                    f'faster there ({cls.__name__}.max_head_dims)')
        return None

    def runs_on(self, x):
        # Triton's interpreter (TRITON_INTERPRET=1) runs the CUDA kernels on CPU tensors
        return x.is_cuda or triton_available(x)

    def forward(self, x, hw_shape, **kwargs):
        self.check_inference(x)
        if self.core != 'triton':  # a Triton call failed earlier: the torch kernel
            return super().forward(x, hw_shape, **kwargs)
        try:
            return super().forward(x, hw_shape, **kwargs)
        except Exception as e:  # compiler, driver: the torch kernel takes over
            note_triton_failure(type(self).__name__, e)
            self.core = 'fast'
            return super().forward(x, hw_shape, **kwargs)


class PolaLinearAttentionTriton(_TritonCore, PolaLinearAttention):
    """The Pola mixer in CUDA inference with :func:`linattn_mm.ops.pola.triton.
    polarity_attention_triton` as its core."""
    base_class = PolaLinearAttention


class NormAwareLinearAttentionTriton(_TritonCore, NormAwareLinearAttention):
    """The NaLa mixer (official kernel) in CUDA inference with :func:`linattn_mm.ops.nala.triton.
    nala_attention_triton` as its core."""
    base_class = NormAwareLinearAttention

    @classmethod
    def unsupported(cls, module):
        too_large = super().unsupported(module)
        if too_large is not None:
            return too_large
        if module.kernel != 'official':
            return f"the Triton core runs the official kernel (kernel='{module.kernel}')"
        if module.query_power is not None:
            return 'the Triton core runs the norm-aware power'
        if module.lepe is None:
            return 'the Triton form runs the official layer with its LePE'
        return None
