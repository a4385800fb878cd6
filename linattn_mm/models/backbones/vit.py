"""DeiT / ViT skeleton with a simple feature pyramid for dense prediction.

Module names follow the official DeiT code (``patch_embed.proj``, ``cls_token``, ``pos_embed``,
``blocks.{i}``, ``norm``), so official DeiT checkpoints load without renaming.
"""
import warnings

import torch
import torch.nn as nn

from linattn_mm.registry import register_backbone
from ..utils.layers import PatchEmbed, make_blocks, nlc_to_nchw, resize_grid_embed
from .base import LinAttnBackbone, drop_path_rates, resolve_arch

_VIT_KEYS = ('embed_dims', 'depth', 'num_heads')


def default_out_indices(depth):
    """The blocks that feed the pyramid by default: the last of each quarter of the depth."""
    return tuple(depth * (q + 1) // 4 - 1 for q in range(4))


class ChannelLayerNorm(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW map."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


@register_backbone
class LinAttnViT(LinAttnBackbone):
    """DeiT / ViT (Touvron et al., ICML 2021) with any token mixer.

    Args:
        arch (str | dict): ``'t'|'s'|'b'`` (aliases ``deit-tiny``, ``deit-small``, ``deit-base``)
            or a dict with ``embed_dims, depth, num_heads``.
        in_channels (int), pretrain_img_size (int), patch_size (int): stem; ``pos_embed`` is sized
            for ``pretrain_img_size`` and resized (bicubic) to every input.
        attn_cfg (dict): token mixer of every block (of the one stage; a list of one dict is
            taken too). Default ``dict(type='GlobalSoftmaxAttention')``.
        with_cls_token (bool): prepend a class token (passed to mixers as one extra token).
        out_type (str): ``'featmap'`` — a simple feature pyramid (strides 4, 8, 16, 32) from the
            outputs of the blocks in ``out_indices`` (for FPN/UperNet necks; no final ``norm`` is
            built, as in ViTDet, and a checkpoint's ``norm.*`` is dropped and reported);
            ``'cls_token'`` — the normalised class token (B, C); ``'avg_featmap'`` — the mean of
            the normalised grid tokens (B, C) (classification).
        out_indices (tuple[int]): *block* indices feeding the pyramid levels (4 entries, shallow
            to deep). Default: the last block of each quarter of the depth, ``(2, 5, 8, 11)`` for
            12 blocks. Blocks after the deepest one are not run (a warning says so: they would
            get no gradient, which DDP refuses unless ``find_unused_parameters=True``).
        norm_eps (float): LayerNorm epsilon (1e-6 as in the official DeiT code).
        mlp_ratio, qkv_bias, drop_rate, drop_path_rate, with_cp, frozen_stages (number of blocks),
        norm_eval, pretrained, init_cfg: as the other skeletons.
    """
    arch_zoo = {
        **dict.fromkeys(['t', 'tiny', 'deit-tiny'], dict(embed_dims=192, depth=12, num_heads=3)),
        **dict.fromkeys(['s', 'small', 'deit-small'], dict(embed_dims=384, depth=12,
                                                           num_heads=6)),
        **dict.fromkeys(['b', 'base', 'deit-base'], dict(embed_dims=768, depth=12, num_heads=12)),
    }
    default_attn_cfg = dict(type='GlobalSoftmaxAttention')
    OUT_TYPES = ('featmap', 'cls_token', 'avg_featmap')

    def __init__(self, arch='t', in_channels=3, pretrain_img_size=224, patch_size=16,
                 attn_cfg=None, with_cls_token=True, out_type='featmap', out_indices=None,
                 mlp_ratio=4., qkv_bias=True, drop_rate=0., drop_path_rate=0.1, with_cp=False,
                 norm_eps=1e-6, frozen_stages=-1, norm_eval=False, pretrained=None, init_cfg=None):
        super().__init__(init_cfg, pretrained, frozen_stages, norm_eval)
        self.in_channels = in_channels
        name = type(self).__name__
        a = resolve_arch(name, self.arch_zoo, arch, _VIT_KEYS)
        self.arch_settings = a
        if out_type not in self.OUT_TYPES:
            raise ValueError(f'{name}: unknown out_type {out_type!r}; valid: {self.OUT_TYPES}')
        if out_type == 'cls_token' and not with_cls_token:
            raise ValueError(f"{name}: out_type='cls_token' needs with_cls_token=True")
        C, depth = a['embed_dims'], a['depth']
        self.embed_dims = C
        self.num_stages = depth
        self.out_type = out_type
        if out_type == 'featmap' and depth < 4:
            raise ValueError(f'{name}: the pyramid takes 4 different blocks, and the arch has '
                             f'{depth}; use out_type cls_token or avg_featmap, or a deeper arch')
        if out_indices is None:
            out_indices = default_out_indices(depth)
        out_indices = tuple(out_indices)
        if out_type == 'featmap' and (len(out_indices) != 4 or
                                      any(i < 0 or i >= depth for i in out_indices) or
                                      any(a >= b for a, b in zip(out_indices, out_indices[1:]))):
            raise ValueError(f'{name}: out_indices must be 4 increasing block indices in '
                             f'[0, {depth}), got {out_indices}')
        self.out_indices = out_indices
        # the blocks a featmap forward runs: up to the deepest one that feeds the pyramid
        self.num_run_blocks = max(out_indices) + 1 if out_type == 'featmap' else depth
        if self.num_run_blocks < depth:
            warnings.warn(f'{name}: out_indices={out_indices} are block indices; blocks '
                          f'{self.num_run_blocks}..{depth - 1} feed no output and are not run '
                          f'(their weights get no gradient). The default is the last block of '
                          f'each quarter of the depth, {default_out_indices(depth)}.')
        self.pretrain_img_size = pretrain_img_size
        self.patch_size = patch_size
        self.patch_embed = PatchEmbed(in_channels, C, patch_size, patch_size, norm=False)
        self.num_extra_tokens = 1 if with_cls_token else 0
        pre = pretrain_img_size // patch_size
        self.pretrain_hw = (pre, pre)
        if with_cls_token:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, C))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_extra_tokens + pre * pre, C))
        self.pos_drop = nn.Dropout(drop_rate)
        if isinstance(attn_cfg, (list, tuple)):  # one stage: a list of one config is that one
            if len(attn_cfg) != 1:
                raise ValueError(f'{name}: attn_cfg is one config for the blocks of its one stage '
                                 f'(a dict, or a list of one), got a list of {len(attn_cfg)}')
            attn_cfg = attn_cfg[0]
        self.blocks = make_blocks(
            depth, drop_path_rates(drop_path_rate, [depth])[0], embed_dims=C,
            num_heads=a['num_heads'], attn_cfg=attn_cfg or self.default_attn_cfg,
            mlp_ratio=mlp_ratio, drop_rate=drop_rate, with_cp=with_cp, qkv_bias=qkv_bias,
            norm_eps=norm_eps,
            num_extra_tokens=self.num_extra_tokens, pretrain_hw=self.pretrain_hw, stage_idx=0)
        if out_type == 'featmap':  # the pyramid takes the blocks' outputs, not a final norm
            self.pretrained_ignore_keys = type(self).pretrained_ignore_keys + (r'^norm\.', )
            self.fpn1 = nn.Sequential(
                nn.ConvTranspose2d(C, C, 2, 2), ChannelLayerNorm(C), nn.GELU(),
                nn.ConvTranspose2d(C, C, 2, 2))
            self.fpn2 = nn.ConvTranspose2d(C, C, 2, 2)
            self.fpn3 = nn.Identity()
            self.fpn4 = nn.MaxPool2d(2, 2, ceil_mode=True)
        else:
            self.norm = nn.LayerNorm(C, eps=norm_eps)
        nn.init.trunc_normal_(self.pos_embed, std=.02)
        if with_cls_token:
            nn.init.trunc_normal_(self.cls_token, std=.02)
        self._freeze_stages()

    pretrained_ignore_keys = (r'^head\.', r'^head_dist\.', r'^dist_token$', r'^fc_norm\.')

    def resize_checkpoint_tensor(self, name, src):
        """``pos_embed`` of a checkpoint from another pretraining size (or with other class /
        distillation rows): grid resized bicubically, class rows kept. Other names: not resized."""
        if name != 'pos_embed':
            return None
        from linattn_mm.checkpoint.resize import resize_pos_embed
        return resize_pos_embed(name, src, self.pos_embed.shape)

    def stem_modules(self):
        mods = [self.patch_embed, self.pos_embed]
        if self.num_extra_tokens:
            mods.append(self.cls_token)
        return mods

    def stage_modules(self, i):
        return [self.blocks[i]]

    def forward(self, x):
        self.check_image(x)
        x, hw = self.patch_embed(x)
        pos = resize_grid_embed(self.pos_embed, self.pretrain_hw, hw, self.num_extra_tokens)
        if self.num_extra_tokens:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + pos)
        feats = []
        for i, blk in enumerate(self.blocks[:self.num_run_blocks]):
            x = blk(x, hw)
            if self.out_type == 'featmap' and i in self.out_indices:
                feats.append(nlc_to_nchw(x[:, self.num_extra_tokens:], hw))
        if self.out_type == 'cls_token':
            return (self.norm(x)[:, 0], )
        if self.out_type == 'avg_featmap':
            return (self.norm(x)[:, self.num_extra_tokens:].mean(1), )
        return tuple(fpn(f) for fpn, f in zip((self.fpn1, self.fpn2, self.fpn3, self.fpn4), feats))
