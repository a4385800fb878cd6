"""Swin Transformer skeleton with a per-stage token-mixer config.

Module names follow the official Swin code (``patch_embed``, ``layers.{i}.blocks.{j}``,
``layers.{i}.downsample``), so official Swin checkpoints and those of linear-attention families
built on Swin (e.g. ``layers.0.blocks.0.attn.qkvg``) load without renaming.
"""
import torch
import torch.nn as nn

from linattn_mm.registry import register_backbone
from ..utils.layers import (BlocksThenDownsample, PatchEmbed, PatchMerging, make_blocks,
                            nlc_to_nchw, resize_grid_embed)
from .base import LinAttnBackbone, drop_path_rates, per_stage, resolve_arch

_SWIN_KEYS = ('embed_dims', 'depths', 'num_heads')


class SwinStage(BlocksThenDownsample):
    """Blocks of one stage followed by optional patch merging."""

    def __init__(self, depth, dpr, downsample_dims=None, **block_kwargs):
        super().__init__()
        self.blocks = make_blocks(depth, dpr, **block_kwargs)
        dims = block_kwargs['embed_dims']
        self.downsample = PatchMerging(dims, downsample_dims) if downsample_dims else None


@register_backbone
class LinAttnSwin(LinAttnBackbone):
    """Swin Transformer (Liu et al., ICCV 2021) with any token mixer per stage.

    Args:
        arch (str | dict): ``'t'|'s'|'b'`` (aliases ``tiny``, ``small``, ``base``) or a dict with
            ``embed_dims, depths, num_heads``.
        in_channels (int): input channels. Default 3.
        pretrain_img_size (int): pretraining resolution; size-dependent parameters (absolute
            position embedding, per-stage tables of linear mixers) are sized for it.
        patch_size (int): patch size of the stem. Default 4.
        attn_cfg (dict | list[dict]): token mixer of every stage or one per stage. Default
            ``dict(type='WindowSoftmaxAttention', window_size=7)`` (W-MSA / SW-MSA alternating).
        mlp_ratio (float): FFN ratio. Default 4.
        use_abs_pos_embed (bool): learnable absolute position embedding after the stem.
        out_indices (tuple[int]): stages whose outputs are returned (each through ``norm{i}``).
        norm_eps (float): LayerNorm epsilon (1e-5 as in the official Swin code).
        qkv_bias, drop_rate, drop_path_rate, with_cp, frozen_stages, norm_eval, pretrained,
        init_cfg: see :class:`~linattn_mm.models.backbones.LinAttnPVT`.

    Any H×W works: window mixers pad internally, patch merging pads odd sizes.
    """
    arch_zoo = {
        **dict.fromkeys(['t', 'tiny'], dict(embed_dims=96, depths=[2, 2, 6, 2],
                                            num_heads=[3, 6, 12, 24])),
        **dict.fromkeys(['s', 'small'], dict(embed_dims=96, depths=[2, 2, 18, 2],
                                             num_heads=[3, 6, 12, 24])),
        **dict.fromkeys(['b', 'base'], dict(embed_dims=128, depths=[2, 2, 18, 2],
                                            num_heads=[4, 8, 16, 32])),
    }
    default_attn_cfg = dict(type='WindowSoftmaxAttention', window_size=7)

    def __init__(self, arch='t', in_channels=3, pretrain_img_size=224, patch_size=4, attn_cfg=None,
                 mlp_ratio=4., use_abs_pos_embed=False, out_indices=(0, 1, 2, 3), qkv_bias=True,
                 drop_rate=0., drop_path_rate=0.1, with_cp=False, norm_eps=1e-5, frozen_stages=-1,
                 norm_eval=False, pretrained=None, init_cfg=None):
        super().__init__(init_cfg, pretrained, frozen_stages, norm_eval)
        self.in_channels = in_channels
        name = type(self).__name__
        a = resolve_arch(name, self.arch_zoo, arch, _SWIN_KEYS)
        self.arch_settings = a
        depths = a['depths']
        self.num_stages = len(depths)
        self.num_features = [a['embed_dims'] * 2**i for i in range(self.num_stages)]
        self.embed_dims = self.num_features
        out_indices = tuple(out_indices)
        if not out_indices or any(i < 0 or i >= self.num_stages for i in out_indices):
            raise ValueError(f'{name}: out_indices {out_indices} must lie in [0, {self.num_stages})')
        self.out_indices = out_indices
        self.pretrain_img_size = pretrain_img_size
        self.patch_embed = PatchEmbed(in_channels, a['embed_dims'], patch_size, patch_size)
        pre = pretrain_img_size // patch_size
        self.use_abs_pos_embed = use_abs_pos_embed
        if use_abs_pos_embed:
            self.absolute_pos_embed = nn.Parameter(torch.zeros(1, pre * pre, a['embed_dims']))
            nn.init.trunc_normal_(self.absolute_pos_embed, std=.02)
        self.pos_drop = nn.Dropout(drop_rate)
        attn_cfgs = per_stage(name, attn_cfg or self.default_attn_cfg, self.num_stages)
        dpr = drop_path_rates(drop_path_rate, depths)
        self.layers = nn.ModuleList()
        for i in range(self.num_stages):
            side = pre // 2**i
            self.layers.append(SwinStage(
                depths[i], dpr[i],
                downsample_dims=self.num_features[i + 1] if i < self.num_stages - 1 else None,
                embed_dims=self.num_features[i], num_heads=a['num_heads'][i],
                attn_cfg=attn_cfgs[i], mlp_ratio=mlp_ratio, drop_rate=drop_rate,
                with_cp=with_cp, norm_eps=norm_eps, qkv_bias=qkv_bias, pretrain_hw=(side, side),
                stage_idx=i))
        for i in out_indices:
            self.add_module(f'norm{i}', nn.LayerNorm(self.num_features[i], eps=norm_eps))
        self._freeze_stages()

    def convert_pretrained_state_dict(self, state_dict):
        """Official classification files have one final ``norm``; it becomes the last stage's
        output norm when that stage is an output."""
        last = self.num_stages - 1
        if last in self.out_indices and not any(k.startswith(f'norm{last}.') for k in state_dict):
            state_dict = {(f'norm{last}.' + k[5:] if k.startswith('norm.') else k): v
                          for k, v in state_dict.items()}
        return state_dict

    def resize_checkpoint_tensor(self, name, src):
        """``absolute_pos_embed`` of a checkpoint from another pretraining size: grid resized
        bicubically. Other names: not resized."""
        if name != 'absolute_pos_embed':
            return None
        from linattn_mm.checkpoint.resize import resize_pos_embed
        return resize_pos_embed(name, src, self.absolute_pos_embed.shape)

    def stem_modules(self):
        mods = [self.patch_embed]
        if self.use_abs_pos_embed:
            mods.append(self.absolute_pos_embed)
        return mods

    def stage_modules(self, i):
        mods = [self.layers[i]]
        if hasattr(self, f'norm{i}'):
            mods.append(getattr(self, f'norm{i}'))
        return mods

    def forward(self, x):
        self.check_image(x)
        x, hw = self.patch_embed(x)
        if self.use_abs_pos_embed:
            side = self.pretrain_img_size // self.patch_embed.stride
            x = x + resize_grid_embed(self.absolute_pos_embed, (side, side), hw, mode='bicubic')
        x = self.pos_drop(x)
        outs = []
        for i, stage in enumerate(self.layers):
            out, out_hw, x, hw = stage(x, hw)
            if i in self.out_indices:
                outs.append(nlc_to_nchw(getattr(self, f'norm{i}')(out), out_hw))
        return tuple(outs)
