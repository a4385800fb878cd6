"""Inference forms of the blocks and stems (CPU).

* :class:`TransformerBlockCPU` — the second half ``x + mlp(norm2(x))`` of the PVT / Swin / ViT
  blocks as :func:`linattn_mm.ops.ffn.ffn_residual_`: 1024 tokens at a time, the activation and
  the residual in place (up to 2.3x faster at stage-1 sizes, equal at stage 3-4 sizes);
* :class:`PatchEmbedCPU` — non-overlapping patch embedding as one GEMM on the gathered patches
  (a strided conv of a channels-last stage output was 2-3x slower at high resolution);
* NaLaFormer: :class:`ConvStemCPU`, :class:`ConvPatchMergingCPU` (BatchNorm and GELU in place on
  the fresh conv outputs) and :class:`NaLaBlockCPU` (the residual sums in place, the ConvFFN half
  in bands of image rows by :func:`linattn_mm.ops.ffn.conv_ffn_residual_`, on the channels-last
  maps NaLaFormer works on).

These forms call layers of a block as functions and update fresh buffers in place: forward hooks
on modules inside a converted block may not run. :func:`linattn_mm.deploy.convert` leaves modules
that have hooks at conversion unconverted; register hooks on an unconverted model.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from linattn_mm.models.backbones.nalaformer import ConvPatchMerging, ConvStem, NaLaBlock
from linattn_mm.models.utils.grid import nchw_to_nlc, nlc_to_nchw
from linattn_mm.models.utils.layers import PatchEmbed, TransformerBlock
from linattn_mm.ops.ffn import channels_last_map, conv_ffn_residual_, ffn_residual_
from .common import InferenceForm

__all__ = ['TransformerBlockCPU', 'PatchEmbedCPU', 'ConvStemCPU', 'ConvPatchMergingCPU',
           'NaLaBlockCPU']


class TransformerBlockCPU(InferenceForm, TransformerBlock):
    """The transformer block with its FFN half ``x += fc2(gelu(fc1(norm2(x))))`` done in place on
    the fresh sum of the attention half, chunk by chunk (same result as the plain form)."""
    base_class = TransformerBlock

    @classmethod
    def unsupported(cls, module):
        if module.mlp.dwconv is not None:
            return 'the fused FFN has no depth-wise conv (PVTv2 FFN)'
        if type(module.mlp.act) is not nn.GELU or type(module.norm2) is not nn.LayerNorm:
            return 'the fused FFN needs the nn.GELU and nn.LayerNorm of the block'
        return None

    def forward(self, x, hw_shape):
        self.check_inference(x)
        x = x + self.drop_path(self.attn(self.norm1(x), hw_shape))
        mlp, norm = self.mlp, self.norm2
        return ffn_residual_(x, norm.weight, norm.bias, norm.eps, mlp.fc1.weight, mlp.fc1.bias,
                             mlp.fc2.weight, mlp.fc2.bias, mlp.act.approximate)


class PatchEmbedCPU(InferenceForm, PatchEmbed):
    """Non-overlapping patch embedding as one GEMM on the gathered patches: the same sums as the
    strided conv."""
    base_class = PatchEmbed

    @classmethod
    def unsupported(cls, module):
        if module.kernel_size != module.stride or module.proj.padding != (0, 0):
            return 'the GEMM form embeds non-overlapping patches only'
        return None

    def forward(self, x):
        self.check_inference(x)
        x = self.pad(x)
        B, C, H, W = x.shape
        p = self.stride
        h, w = H // p, W // p
        patches = x.permute(0, 2, 3, 1).reshape(B, h, p, w, p, C).transpose(2, 3)
        weight = self.proj.weight.permute(0, 2, 3, 1).reshape(self.proj.out_channels, p * p * C)
        out = F.linear(patches.reshape(B * h * w, p * p * C), weight, self.proj.bias)
        out = out.view(B, h * w, -1)
        if self.norm is not None:
            out = self.norm(out)
        return out, (h, w)


def _bn_inplace_(bn, x):
    """An eval-mode BatchNorm with running statistics applied in place to ``x`` (NCHW or
    channels-last) as the per-channel affine map ``x * a + b`` it amounts to; any other norm is
    called out of place."""
    if bn.training or not bn.track_running_stats or bn.running_mean is None:
        return bn(x)
    a = torch.rsqrt(bn.running_var.to(x.dtype) + bn.eps)
    if bn.weight is not None:
        a = a * bn.weight.to(x.dtype)
    b = -bn.running_mean.to(x.dtype) * a
    if bn.bias is not None:
        b = b + bn.bias.to(x.dtype)
    return x.mul_(a.view(1, -1, 1, 1)).add_(b.view(1, -1, 1, 1))


def _conv_bn_act(layers, x):
    """``layers`` (convs, BatchNorms, GELUs in sequence): each conv as a function, each norm and
    activation in place on the fresh output of the conv before it, so the chain makes one map per
    conv instead of one per layer."""
    fresh = False
    for layer in layers:
        if isinstance(layer, nn.Conv2d):
            x = layer._conv_forward(x, layer.weight, layer.bias)
            fresh = True
        elif fresh and isinstance(layer, _BatchNorm):
            x = _bn_inplace_(layer, x)
        elif fresh and type(layer) is nn.GELU:
            x = torch.ops.aten.gelu_(x, approximate=layer.approximate)
        else:
            x = layer(x)
            fresh = False
    return x


class ConvStemCPU(InferenceForm, ConvStem):
    """NaLaFormer's conv stem with BatchNorm and GELU in place on the fresh conv outputs."""
    base_class = ConvStem

    def forward(self, x):
        self.check_inference(x)
        return _conv_bn_act(self.proj, x)


class ConvPatchMergingCPU(InferenceForm, ConvPatchMerging):
    """NaLaFormer's downsampling conv with its BatchNorm in place."""
    base_class = ConvPatchMerging

    def forward(self, x):
        self.check_inference(x)
        return _conv_bn_act((self.reduction, self.norm), x)


def _conv(conv, x):
    return conv._conv_forward(x, conv.weight, conv.bias)


class NaLaBlockCPU(InferenceForm, NaLaBlock):
    """A NaLaFormer block with the residual sums in place on the fresh branch outputs and the
    ConvFFN half ``x += gamma_2 * fc2(h + dwconv(h))``, ``h = gelu(fc1(norm2(x)))``, in bands of
    image rows with no map of the hidden width made whole. Needs a channels-last map (as
    NaLaFormer's forward makes them)."""
    base_class = NaLaBlock

    @classmethod
    def unsupported(cls, module):
        dw = module.ffn.dwconv
        if type(module.ffn.act) is not nn.GELU or type(module.norm2.norm) is not nn.LayerNorm:
            return 'the banded ConvFFN needs the nn.GELU and nn.LayerNorm of the block'
        if (dw.kernel_size, dw.stride, dw.padding, dw.dilation, dw.groups) != (
                (3, 3), (1, 1), (1, 1), (1, 1), dw.in_channels):
            return 'the banded ConvFFN needs a depth-wise 3 x 3 conv with stride 1 and padding 1'
        return None

    def forward(self, x, rope=None):
        self.check_inference(x)
        if self.cpe1 is not None:
            x = _conv(self.cpe1, x).add_(x)
        hw = tuple(x.shape[-2:])
        t = nchw_to_nlc(self.norm1.forward(x))  # module forwards without hooks: updated in place
        t = self.attn.forward(t, hw, rope=rope) if self.takes_rope else self.attn.forward(t, hw)
        a = nlc_to_nchw(t, hw)
        x = (a.mul_(self.gamma_1) if self.layer_scale else a).add_(x)
        if self.cpe2 is not None:
            x = _conv(self.cpe2, x).add_(x)
        if not channels_last_map(x):
            raise RuntimeError(f'{type(self).__name__}: the banded ConvFFN updates a channels-last '
                               f'map in place; run the block inside a converted NaLaFormer')
        ffn, norm = self.ffn, self.norm2.norm
        return conv_ffn_residual_(
            x, norm.weight, norm.bias, norm.eps, ffn.fc1.weight, ffn.fc1.bias, ffn.dwconv.weight,
            ffn.dwconv.bias, ffn.fc2.weight, ffn.fc2.bias,
            self.gamma_2.view(-1) if self.layer_scale else None, ffn.act.approximate)
