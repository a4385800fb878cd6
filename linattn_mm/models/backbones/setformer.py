"""SeTformer (Shamsolmoali et al., AAAI 2024): a four-stage hierarchy with SeT attention.

The paper calls Swin its baseline, but its depths (Table 1), stem ("two-layer 3×3 convolutions with
2×2 strides") and downsampler (3×3 stride-2 conv) are exactly NAT's (Hassani et al., CVPR 2023), so
this is NAT's macro design with SeT in place of neighbourhood attention. The paper gives no widths,
heads, MLP ratios, drop-path rates or layer scale: they are NAT's for the same depths (both choices
documented in ``docs/model_zoo/setformer.md``, "Backbone")::

    stem        conv3x3 s2 (C/2) -> conv3x3 s2 (C) -> LayerNorm          ``patch_embed.{proj,norm}``
    stage i     blocks  x + DropPath(γ1·SeT(LN(x))); x + DropPath(γ2·MLP(LN(x)))
                                                                          ``layers.{i}.blocks.{j}``
    downsample  conv3x3 s2 (2C, no bias) -> LayerNorm                     ``layers.{i}.downsample``
    outputs     LayerNorm per returned stage (before downsampling)        ``norm{i}``

Any input size works (stride-2 convs with padding 1 give ceil(H/2)); SeT is global, so nothing
depends on the resolution.
"""
import copy

import torch
import torch.nn as nn

from linattn_mm.ops.lean_layers import recomputed
from linattn_mm.registry import register_backbone
from ..attentions.base import build_attention
from ..utils.layers import BlocksThenDownsample, DropPath, Mlp, nchw_to_nlc, nlc_to_nchw
from .base import (LinAttnBackbone, drop_path_rates, init_transformer_weights_fan_out, per_stage,
                   resolve_arch)

_ARCH_KEYS = ('embed_dims', 'depths', 'num_heads', 'mlp_ratio')


def _arch(dims, depths, heads, mlp_ratio, drop_path_rate, layer_scale):
    return dict(embed_dims=dims, depths=list(depths), num_heads=list(heads), mlp_ratio=mlp_ratio,
                drop_path_rate=drop_path_rate, layer_scale_init_value=layer_scale)


class ConvTokenizer(nn.Module):
    """NAT stem: conv3x3 s2 p1 (C/2), conv3x3 s2 p1 (C), LayerNorm. Keys ``proj.{0,1}``,
    ``norm``."""

    def __init__(self, in_channels, embed_dims):
        super().__init__()
        self.proj = nn.Sequential(
            nn.Conv2d(in_channels, embed_dims // 2, 3, 2, 1),
            nn.Conv2d(embed_dims // 2, embed_dims, 3, 2, 1))
        self.norm = nn.LayerNorm(embed_dims)

    def forward(self, x):
        x = self.proj(x)
        hw = tuple(x.shape[-2:])
        return self.norm(nchw_to_nlc(x)), hw


class ConvDownsampler(nn.Module):
    """NAT downsampler: conv3x3 s2 p1 (no bias) to ``out_dims``, LayerNorm. Keys ``reduction``,
    ``norm``."""

    def __init__(self, in_dims, out_dims):
        super().__init__()
        self.reduction = nn.Conv2d(in_dims, out_dims, 3, 2, 1, bias=False)
        self.norm = nn.LayerNorm(out_dims)

    def forward(self, x, hw_shape):
        x = self.reduction(nlc_to_nchw(x, hw_shape))
        hw = tuple(x.shape[-2:])
        return self.norm(nchw_to_nlc(x)), hw


class SeTBlock(nn.Module):
    """Pre-norm block with optional LayerScale (NAT-S/B use 1e-5)::

        x = x + DropPath(gamma_1 * attn(norm1(x)))
        x = x + DropPath(gamma_2 * mlp(norm2(x)))
    """

    def __init__(self, embed_dims, num_heads, attn_cfg, mlp_ratio=3., drop_path=0., drop_rate=0.,
                 layer_scale_init_value=None, with_cp=False, **context):
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dims)
        self.attn = build_attention(attn_cfg, embed_dims=embed_dims, num_heads=num_heads,
                                    proj_drop=drop_rate, **context)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(embed_dims)
        self.mlp = Mlp(embed_dims, int(embed_dims * mlp_ratio), drop_rate)
        self.layer_scale = bool(layer_scale_init_value)
        if self.layer_scale:
            self.gamma_1 = nn.Parameter(torch.full((embed_dims, ), float(layer_scale_init_value)))
            self.gamma_2 = nn.Parameter(torch.full((embed_dims, ), float(layer_scale_init_value)))
        self.with_cp = with_cp

    def _forward(self, x, hw_shape):
        a = self.attn(self.norm1(x), hw_shape)
        x = self.drop_path.add(x, a, self.gamma_1 if self.layer_scale else None)
        f = self.mlp(self.norm2(x), hw_shape)
        return self.drop_path.add(x, f, self.gamma_2 if self.layer_scale else None)

    def forward(self, x, hw_shape):
        if self.with_cp and x.requires_grad:
            return recomputed(self._forward, x, hw_shape)
        return self._forward(x, hw_shape)


class SeTStage(BlocksThenDownsample):
    """Blocks, then the optional downsampler.

    ``forward`` returns ``(out, out_hw, next, next_hw)``."""

    def __init__(self, depth, dpr, downsample_dims=None, **block_kwargs):
        super().__init__()
        self.blocks = nn.ModuleList(
            [SeTBlock(drop_path=dpr[j], block_idx=j, **block_kwargs) for j in range(depth)])
        self.downsample = ConvDownsampler(block_kwargs['embed_dims'], downsample_dims) \
            if downsample_dims else None


@register_backbone
class SeTformer(LinAttnBackbone):
    """SeTformer backbone: NAT macro design (conv stem, conv downsamplers, depths of Table 1) with
    SeT attention in every block.

    Args:
        arch (str | dict): ``'m'``/``'mini'``, ``'t'``/``'tiny'``, ``'s'``/``'small'``,
            ``'b'``/``'base'`` or a dict with keys ``embed_dims`` (int C, stages C·2^i),
            ``depths``, ``num_heads``, ``mlp_ratio`` (and optional ``drop_path_rate``,
            ``layer_scale_init_value``). Depths are the paper's (M [3,4,6,5], T/S/B [3,4,18,5]);
            widths, heads, MLP ratios, drop path and layer scale are NAT's (paper silent):

            ====  ===  ==============  ===  =========  ===========
            arch  C    heads           mlp  drop path  layer scale
            ====  ===  ==============  ===  =========  ===========
            m     64   2, 4, 8, 16     3    0.2        --
            t     64   2, 4, 8, 16     3    0.2        --
            s     96   3, 6, 12, 24    2    0.3        1e-5
            b     128  4, 8, 16, 32    2    0.5        1e-5
            ====  ===  ==============  ===  =========  ===========
        in_channels (int): input channels. Default 3.
        pretrain_img_size (int): classification resolution; mixers with size-dependent
            parameters (e.g. PolaFormer's positional encoding) get the stage grid at this size
            (``pretrain_img_size // 4 // 2**i``) and resize it to the input. Default 224.
        attn_cfg (dict | list[dict], optional): token mixer of every stage or one per stage.
            Default ``dict(type='SeTAttention', num_refs=500, eps=0.1, tau=0.5)`` (paper,
            ImageNet; COCO: 750 / 0.3 / 0.8, ADE20K: 800 / 0.3 / 0.8).
        out_indices (Sequence[int]): stages returned (NCHW, each through LayerNorm ``norm{i}``).
            Default (0, 1, 2, 3).
        qkv_bias (bool): bias of the value (key) projections. Default True.
        drop_rate (float): dropout in MLPs and after the attention projection. Default 0.
        drop_path_rate (float, optional): stochastic depth (linear over blocks); None = the arch's.
        layer_scale_init_value (float, optional): LayerScale init; None = the arch's, 0 disables.
        with_cp (bool): gradient checkpointing per block. Default False.
        frozen_stages (int): freeze the stem and the first ``frozen_stages`` stages (with their
            downsampler and output norm). Default -1.
        norm_eval (bool): BatchNorm layers in eval mode (there are none; kept for the mm API).
        pretrained (str, optional): deprecated, use ``init_cfg``.
        init_cfg (dict, optional): ``dict(type='Pretrained', checkpoint=...)``. References of a
            checkpoint trained with another m are adapted (K-means / copies, see
            :func:`linattn_mm.models.attentions.setformer.resize_refs`).
    """
    #: SeTformer has no official code. Its convs (stem, downsamplers, any mixer's) take the
    #: fan-out normal init of PVTv2's code; NAT's code leaves them at PyTorch's default. Kept so:
    #: the learning check (docs/fidelity.md) and the demo were measured with it.
    default_init = staticmethod(init_transformer_weights_fan_out)
    arch_zoo = {
        **dict.fromkeys(['m', 'mini'], _arch(64, (3, 4, 6, 5), (2, 4, 8, 16), 3., 0.2, None)),
        **dict.fromkeys(['t', 'tiny'], _arch(64, (3, 4, 18, 5), (2, 4, 8, 16), 3., 0.2, None)),
        **dict.fromkeys(['s', 'small'], _arch(96, (3, 4, 18, 5), (3, 6, 12, 24), 2., 0.3, 1e-5)),
        **dict.fromkeys(['b', 'base'], _arch(128, (3, 4, 18, 5), (4, 8, 16, 32), 2., 0.5, 1e-5)),
    }
    default_attn_cfg = dict(type='SeTAttention', num_refs=500, eps=0.1, tau=0.5)

    def __init__(self, arch='t', in_channels=3, pretrain_img_size=224, attn_cfg=None,
                 out_indices=(0, 1, 2, 3), qkv_bias=True, drop_rate=0., drop_path_rate=None,
                 layer_scale_init_value=None, with_cp=False, frozen_stages=-1, norm_eval=False,
                 pretrained=None, init_cfg=None):
        super().__init__(init_cfg, pretrained, frozen_stages, norm_eval)
        self.in_channels = in_channels
        name = type(self).__name__
        a = resolve_arch(name, self.arch_zoo, arch, _ARCH_KEYS)
        self.arch_settings = a
        depths = list(a['depths'])
        self.num_stages = len(depths)
        self.embed_dims = [a['embed_dims'] * 2**i for i in range(self.num_stages)]
        self.num_features = self.embed_dims
        out_indices = tuple(out_indices)
        if not out_indices or any(i < 0 or i >= self.num_stages for i in out_indices):
            raise ValueError(f'{name}: out_indices {out_indices} must lie in '
                             f'[0, {self.num_stages})')
        self.out_indices = out_indices
        if drop_path_rate is None:
            drop_path_rate = a.get('drop_path_rate', 0.2)
        if layer_scale_init_value is None:
            layer_scale_init_value = a.get('layer_scale_init_value')
        self.drop_path_rate = drop_path_rate
        attn_cfgs = per_stage(name, attn_cfg or self.default_attn_cfg, self.num_stages)
        dpr = drop_path_rates(drop_path_rate, depths)

        self.patch_embed = ConvTokenizer(in_channels, self.embed_dims[0])
        self.layers = nn.ModuleList()
        for i in range(self.num_stages):
            self.layers.append(SeTStage(
                depths[i], dpr[i],
                downsample_dims=self.embed_dims[i + 1] if i < self.num_stages - 1 else None,
                embed_dims=self.embed_dims[i], num_heads=a['num_heads'][i],
                attn_cfg=copy.deepcopy(attn_cfgs[i]), mlp_ratio=a['mlp_ratio'],
                drop_rate=drop_rate, layer_scale_init_value=layer_scale_init_value,
                with_cp=with_cp, qkv_bias=qkv_bias, stage_idx=i,
                pretrain_hw=(max(1, pretrain_img_size // 4 // 2**i), ) * 2))
        for i in out_indices:
            self.add_module(f'norm{i}', nn.LayerNorm(self.embed_dims[i]))
        self._freeze_stages()

    def convert_pretrained_state_dict(self, state_dict):
        """A classification checkpoint with one final ``norm`` (no ``norm{i}``) gives it to the
        last stage's output norm."""
        last = self.num_stages - 1
        if last in self.out_indices and not any(k.startswith(f'norm{last}.') for k in state_dict):
            state_dict = {(f'norm{last}.' + k[5:] if k.startswith('norm.') else k): v
                          for k, v in state_dict.items()}
        return state_dict

    def stem_modules(self):
        return [self.patch_embed]

    def stage_modules(self, i):
        mods = [self.layers[i]]
        if hasattr(self, f'norm{i}'):
            mods.append(getattr(self, f'norm{i}'))
        return mods

    def forward(self, x):
        self.check_image(x)
        x, hw = self.patch_embed(x)
        outs = []
        for i, stage in enumerate(self.layers):
            out, out_hw, x, hw = stage(x, hw)
            if i in self.out_indices:
                outs.append(nlc_to_nchw(getattr(self, f'norm{i}')(out), out_hw).contiguous())
        return tuple(outs)
