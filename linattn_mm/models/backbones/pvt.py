"""PVT (v1) and PVTv2 skeletons with a per-stage token-mixer config.

Module names follow the official PVT / PVTv2 code (``patch_embed{i}``, ``pos_embed{i}``,
``block{i}.{j}``, ``norm{i}``), so official ImageNet checkpoints (and those of linear-attention
families built on PVT) load without renaming.
"""
import re

import torch
import torch.nn as nn

from linattn_mm.registry import register_backbone
from ..utils.layers import PatchEmbed, make_blocks, nlc_to_nchw, resize_grid_embed
from .base import (LinAttnBackbone, drop_path_rates, init_transformer_weights_fan_out, per_stage,
                   resolve_arch)

_PVT_KEYS = ('embed_dims', 'depths', 'num_heads', 'mlp_ratios', 'sr_ratios')


def _pvt_arch(depths, dims=(64, 128, 320, 512), mlp_ratios=(8, 8, 4, 4)):
    return dict(embed_dims=list(dims), depths=list(depths), num_heads=[1, 2, 5, 8],
                mlp_ratios=list(mlp_ratios), sr_ratios=[8, 4, 2, 1])


class _PVTBase(LinAttnBackbone):
    """Four-stage pyramid of patch embedding + transformer blocks (shared by PVT and PVTv2; the
    class attributes say where the two differ)."""
    #: PVT v1: an absolute position embedding ``pos_embed{i}`` added after each patch embedding
    absolute_pos_embed = True
    #: PVTv2: a 3x3 depth-wise conv in the FFN and a LayerNorm ``norm{i}`` after every stage
    conv_ffn_and_stage_norms = False
    default_attn_cfg = dict(type='SRSoftmaxAttention')

    def __init__(self, arch, in_channels=3, pretrain_img_size=224, attn_cfg=None,
                 out_indices=(0, 1, 2, 3), qkv_bias=True, drop_rate=0., drop_path_rate=0.1,
                 with_cp=False, norm_eps=1e-6, frozen_stages=-1, norm_eval=False,
                 pretrained=None, init_cfg=None):
        super().__init__(init_cfg, pretrained, frozen_stages, norm_eval)
        self.in_channels = in_channels
        name = type(self).__name__
        a = resolve_arch(name, self.arch_zoo, arch, _PVT_KEYS)
        self.arch_settings = a
        self.num_stages = len(a['depths'])
        self.embed_dims = a['embed_dims']
        out_indices = tuple(out_indices)
        if not out_indices or any(i < 0 or i >= self.num_stages for i in out_indices):
            raise ValueError(f'{name}: out_indices {out_indices} must lie in [0, {self.num_stages})')
        self.out_indices = out_indices
        self.pretrain_img_size = pretrain_img_size
        attn_cfgs = per_stage(name, attn_cfg or self.default_attn_cfg, self.num_stages)
        dpr = drop_path_rates(drop_path_rate, a['depths'])
        self.strides = []
        stride, prev = 1, in_channels
        for i in range(self.num_stages):
            k, s, p = self.patch_geometry(i)
            stride *= s
            self.strides.append(stride)
            # the official PatchEmbed / OverlapPatchEmbed build nn.LayerNorm(C): eps 1e-5, not
            # the blocks' norm_eps
            setattr(self, f'patch_embed{i + 1}', PatchEmbed(prev, a['embed_dims'][i], k, s, p))
            pre_hw = (pretrain_img_size // stride, pretrain_img_size // stride)
            if self.absolute_pos_embed:
                pos_embed = nn.Parameter(torch.zeros(1, pre_hw[0] * pre_hw[1], a['embed_dims'][i]))
                nn.init.trunc_normal_(pos_embed, std=.02)
                setattr(self, f'pos_embed{i + 1}', pos_embed)
            setattr(self, f'block{i + 1}', make_blocks(
                a['depths'][i], dpr[i], embed_dims=a['embed_dims'][i],
                num_heads=a['num_heads'][i], attn_cfg=attn_cfgs[i], mlp_ratio=a['mlp_ratios'][i],
                drop_rate=drop_rate, dwconv_mlp=self.conv_ffn_and_stage_norms, with_cp=with_cp,
                norm_eps=norm_eps,
                sr_ratio=a['sr_ratios'][i], qkv_bias=qkv_bias, pretrain_hw=pre_hw,
                stage_idx=i))
            if self.conv_ffn_and_stage_norms:
                setattr(self, f'norm{i + 1}', nn.LayerNorm(a['embed_dims'][i], eps=norm_eps))
            prev = a['embed_dims'][i]
        self.pos_drop = nn.Dropout(drop_rate)
        self._freeze_stages()

    def patch_geometry(self, i):
        raise NotImplementedError

    @property
    def min_input_size(self):
        """Smallest input side for which every spatial-reduction conv gets a full window (the
        reduction of each stage's mixer, which its config may set apart from the arch's)."""
        need = 1
        for i, stride in enumerate(self.strides):
            attn = getattr(self, f'block{i + 1}')[0].attn
            sr = 1 if getattr(attn, 'linear', False) else max(1, getattr(attn, 'sr_ratio', 1))
            need = max(need, (sr - 1) * stride + 1)
        return need

    def stem_modules(self):
        return []

    def stage_modules(self, i):
        mods = [getattr(self, f'patch_embed{i + 1}'), getattr(self, f'block{i + 1}')]
        if self.absolute_pos_embed:
            mods.append(getattr(self, f'pos_embed{i + 1}'))
        else:
            mods.append(getattr(self, f'norm{i + 1}'))
        return mods

    def forward(self, x):
        self.check_image(x)
        H, W = x.shape[-2:]
        if min(H, W) < self.min_input_size:
            raise ValueError(f'{type(self).__name__}: input {H}x{W} is smaller than the minimum '
                             f'{self.min_input_size}x{self.min_input_size} for this arch')
        outs = []
        for i in range(self.num_stages):
            x, hw = getattr(self, f'patch_embed{i + 1}')(x)
            if self.absolute_pos_embed:
                pos = getattr(self, f'pos_embed{i + 1}')
                side = self.pretrain_img_size // self.strides[i]
                pos = resize_grid_embed(pos, (side, side), hw, mode='bilinear')
                x = self.pos_drop(x + pos)
            for blk in getattr(self, f'block{i + 1}'):
                x = blk(x, hw)
            if self.conv_ffn_and_stage_norms:
                x = getattr(self, f'norm{i + 1}')(x)
            x = nlc_to_nchw(x, hw)
            if i in self.out_indices:
                outs.append(x)
        return tuple(outs)


@register_backbone
class LinAttnPVT(_PVTBase):
    """PVT v1 skeleton (Wang et al., ICCV 2021) with any token mixer per stage.

    Args:
        arch (str | dict): ``'t'|'s'|'m'|'l'`` (aliases ``tiny`` … ``large``) or a dict with
            ``embed_dims, depths, num_heads, mlp_ratios, sr_ratios``.
        in_channels (int): input channels. Default 3.
        pretrain_img_size (int): resolution the absolute position embeddings (and any
            size-dependent attention parameter) are sized for; they are resized to the input.
        attn_cfg (dict | list[dict]): token mixer of every stage, or one per stage. Default
            ``dict(type='SRSoftmaxAttention')`` (PVT spatial-reduction attention; the arch's
            ``sr_ratios`` are passed to mixers that take ``sr_ratio``).
        out_indices (tuple[int]): stages whose (NCHW) outputs are returned.
        qkv_bias (bool), drop_rate (float), drop_path_rate (float): as in PVT.
        with_cp (bool): gradient checkpointing per block.
        norm_eps (float): LayerNorm epsilon of the blocks (and of PVTv2's stage norms); 1e-6 as
            in the official PVT code. The patch embeddings' LayerNorms have PyTorch's 1e-5, as
            the official ``PatchEmbed`` / ``OverlapPatchEmbed`` (mmdet's PVT uses 1e-6 there).
        frozen_stages (int): stages (from the first) with frozen weights; -1 freezes nothing.
        norm_eval (bool): keep BatchNorm layers in eval mode while training.
        pretrained (str, deprecated) / init_cfg (dict): ``dict(type='Pretrained', checkpoint=…)``
            loads official, mmpretrain or raw checkpoints (see :mod:`linattn_mm.checkpoint`).

    The official PVT v1 class token and final norm are classification-only; they are dropped
    (and reported) when loading. Stage maps are returned without extra norms, as in the official
    detection code; for classification use global average pooling over the last stage.
    """
    arch_zoo = {
        **dict.fromkeys(['t', 'tiny'], _pvt_arch([2, 2, 2, 2])),
        **dict.fromkeys(['s', 'small'], _pvt_arch([3, 4, 6, 3])),
        **dict.fromkeys(['m', 'medium'], _pvt_arch([3, 4, 18, 3])),
        **dict.fromkeys(['l', 'large'], _pvt_arch([3, 8, 27, 3])),
    }
    pretrained_ignore_keys = (r'^cls_token$', r'^norm\.')

    def patch_geometry(self, i):
        return (4, 4, 0) if i == 0 else (2, 2, 0)

    def resize_checkpoint_tensor(self, name, src):
        """``pos_embed{i}`` of a checkpoint from another pretraining size: grid resized
        bilinearly, as the forward resizes it to the input (so that a model loaded at another
        ``pretrain_img_size`` gives the checkpoint model's outputs at that size); the class-token
        row of the official last stage is dropped (and noted). Other names: not resized."""
        if re.fullmatch(r'pos_embed\d+', name) is None:
            return None
        from linattn_mm.checkpoint.resize import resize_pos_embed
        return resize_pos_embed(name, src, getattr(self, name).shape, mode='bilinear')


@register_backbone
class LinAttnPVTv2(_PVTBase):
    """PVTv2 skeleton (Wang et al., CVMJ 2022): overlapping patch embedding, depth-wise conv FFN,
    no absolute position embedding, a LayerNorm after every stage. Arguments as
    :class:`LinAttnPVT`; arch ``'b0'`` … ``'b5'``. ``attn_cfg=dict(type='SRSoftmaxAttention',
    linear=True)`` gives the linear-SRA (``-li``) attention."""
    absolute_pos_embed = False
    conv_ffn_and_stage_norms = True
    #: the official PVTv2 code also gives convolutions a fan-out normal init (PVT v1's leaves them
    #: at PyTorch's default)
    default_init = staticmethod(init_transformer_weights_fan_out)
    arch_zoo = {
        'b0': _pvt_arch([2, 2, 2, 2], dims=(32, 64, 160, 256)),
        'b1': _pvt_arch([2, 2, 2, 2]),
        'b2': _pvt_arch([3, 4, 6, 3]),
        'b3': _pvt_arch([3, 4, 18, 3]),
        'b4': _pvt_arch([3, 8, 27, 3]),
        'b5': _pvt_arch([3, 6, 40, 3], mlp_ratios=(4, 4, 4, 4)),
    }

    def patch_geometry(self, i):
        return (7, 4, 3) if i == 0 else (3, 2, 1)
