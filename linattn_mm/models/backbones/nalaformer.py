"""NaLaFormer: the native four-stage hierarchy of the official code (``ZacharyMeng/NaLaFormer``,
``NaLaformer/NALA.py``), an NCHW network in the RMT / MALA style.

Module names equal the official ones (``patch_embed.proj.{0..10}``, ``layers.{i}.RoPE.angle``,
``layers.{i}.blocks.{j}.{norm1,attn,norm2,ffn,cpe1,cpe2,gamma_1,gamma_2}``,
``layers.{i}.downsample.{reduction,norm}``, ``proj``, ``norm``, ``head``), so official files
(``{'model': ..., 'model_ema': ...}``) load without renaming.
"""
import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from linattn_mm.ops.dispatch import check_core
from linattn_mm.ops.ffn import conv_ffn_branch
from linattn_mm.ops.lean_layers import recomputed
from linattn_mm.registry import register_backbone
from ..attentions.base import build_attention
from ..attentions.nala import NaLaMixerBase, RoPE2d
from ..utils.layers import DropPath, build_bn, nchw_to_nlc, nlc_to_nchw
from .base import LinAttnBackbone, drop_path_rates, per_stage, resolve_arch

_ARCH_KEYS = ('embed_dims', 'depths', 'num_heads', 'mlp_ratios')

#: the attention of the released models: NaLa in stages 1-2, NaLa's softmax block in stages 3-4
NALA = dict(type='NormAwareLinearAttention')
SOFTMAX = dict(type='NaLaSoftmaxAttention')
RELEASED_ATTN_CFG = (NALA, NALA, SOFTMAX, SOFTMAX)


class LayerNorm2d(nn.Module):
    """LayerNorm over the channels of an NCHW map (key ``norm``, eps 1e-6 as in the code)."""

    def __init__(self, dims, eps=1e-6):
        super().__init__()
        self.norm = nn.LayerNorm(dims, eps=eps)

    def forward(self, x):
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvStem(nn.Module):
    """Stride-4 stem: conv3x3 s2 (C/2), BN, GELU, two conv3x3 s1 (C/2) + BN + GELU, conv3x3 s2
    (C), BN. Key ``proj.{0,3,6,9}`` (convs) and ``proj.{1,4,7,10}`` (BNs)."""

    def __init__(self, in_channels, embed_dims, norm_cfg):
        super().__init__()
        half = embed_dims // 2
        self.proj = nn.Sequential(
            nn.Conv2d(in_channels, half, 3, 2, 1), build_bn(norm_cfg, half), nn.GELU(),
            nn.Conv2d(half, half, 3, 1, 1), build_bn(norm_cfg, half), nn.GELU(),
            nn.Conv2d(half, half, 3, 1, 1), build_bn(norm_cfg, half), nn.GELU(),
            nn.Conv2d(half, embed_dims, 3, 2, 1), build_bn(norm_cfg, embed_dims))

    def forward(self, x):
        return self.proj(x)


class ConvPatchMerging(nn.Module):
    """Stride-2 downsampling between stages: conv3x3 s2 p1 (``reduction``) then BN (``norm``)."""

    def __init__(self, in_dims, out_dims, norm_cfg):
        super().__init__()
        self.reduction = nn.Conv2d(in_dims, out_dims, 3, 2, 1)
        self.norm = build_bn(norm_cfg, out_dims)

    def forward(self, x):
        return self.norm(self.reduction(x))


class ConvFFN(nn.Module):
    """``fc2(dwconv(gelu(fc1(x))) + gelu(fc1(x)))`` on an NCHW map (keys ``fc1``, ``dwconv``,
    ``fc2``)."""

    def __init__(self, embed_dims, hidden_dims, drop=0.):
        super().__init__()
        self.fc1 = nn.Linear(embed_dims, hidden_dims)
        self.act = nn.GELU()
        self.dwconv = nn.Conv2d(hidden_dims, hidden_dims, 3, 1, 1, groups=hidden_dims)
        self.fc2 = nn.Linear(hidden_dims, embed_dims)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        x = self.drop(self.act(self.fc1(x.permute(0, 2, 3, 1)))).permute(0, 3, 1, 2)
        x = x + self.dwconv(x)
        return self.drop(self.fc2(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)


#: a block's ``ffn_core`` names: its ConvFFN (and, ``'fused'``, its CPEs) as
#: :class:`~linattn_mm.ops.ffn.ConvFFNBranch`, the plain modules, or the Triton kernels of
#: :mod:`linattn_mm.ops.ffn.fused`
FFN_CORES = ('fast', 'reference', 'fused')


def _cpe_pair(name, use_cpe):
    """``use_cpe`` (a bool, or a pair of bools for ``cpe1`` / ``cpe2``) as a pair of bools."""
    pair = (use_cpe, use_cpe) if isinstance(use_cpe, bool) else tuple(use_cpe) \
        if isinstance(use_cpe, (tuple, list)) else None
    if pair is None or len(pair) != 2 or not all(isinstance(b, bool) for b in pair):
        raise ValueError(f'{name}: use_cpe must be a bool or a pair of bools (cpe1, cpe2), got '
                         f'{use_cpe!r}')
    return pair


class NaLaBlock(nn.Module):
    """One NaLaFormer block on an NCHW map::

        x = x + cpe1(x)
        x = x + drop_path(gamma_1 * attn(norm1(x)))
        x = x + cpe2(x)
        x = x + drop_path(gamma_2 * ffn(norm2(x)))

    The two CPE convs are the official code's; the paper names CPE as its position encoding
    (App. A.2) without saying where or how many. ``use_cpe`` turns them off (both, or one of the
    pair): a CPE turned off is no module and no parameters (its step is ``x = x``).

    Args:
        embed_dims (int): channels.
        num_heads (int): attention heads.
        attn_cfg (dict): attention config (``NormAwareLinearAttention``,
            ``NaLaSoftmaxAttention`` or any other token mixer; NaLa's mixers get the stage's
            shared RoPE).
        mlp_ratio (float): FFN hidden ratio.
        drop_path (float): stochastic depth rate.
        layer_scale_init_value (float, optional): LayerScale init (``gamma_1``, ``gamma_2``);
            ``None`` or 0 disables LayerScale.
        drop_rate (float): dropout in the FFN and after the attention projection.
        block_idx (int), stage_idx (int): position (passed to the attention builder).
        pretrain_hw (tuple[int, int], optional): the stage's grid at the pretraining resolution,
            passed to mixers with size-dependent parameters (e.g. PolaFormer's positional
            encoding).
        use_cpe (bool | tuple[bool, bool]): build ``cpe1`` / ``cpe2`` (one bool for both).
            Defaults to True (official).

    The ConvFFN half runs as :func:`linattn_mm.ops.ffn.conv_ffn_branch` (``ffn_core='fast'``
    without dropout): the same values and gradients, with only the map, its LayerNorm statistics
    and the ``fc1`` output kept for backward; ``ffn_core='reference'`` runs the modules one by one.
    ``ffn_core='fused'`` (CUDA, for training; set by
    :func:`linattn_mm.cli.set_attention_core` with ``'fused'``) runs the ConvFFN's conv sum
    ``h + dwconv(h)`` and the CPEs' ``x + cpe(x)`` as Triton kernels, and the backward of the
    residual sums with their LayerScale (:mod:`linattn_mm.ops.ffn.fused`): the same values and
    gradients (under autocast the CPEs' bias gradients summed in float32), fewer passes over
    memory.
    """

    def __init__(self, embed_dims, num_heads, attn_cfg, mlp_ratio=4., drop_path=0.,
                 layer_scale_init_value=1., drop_rate=0., block_idx=0, stage_idx=0,
                 use_cpe=True, pretrain_hw=None):
        super().__init__()
        cpe1, cpe2 = _cpe_pair(type(self).__name__, use_cpe)
        self.cpe1 = nn.Conv2d(embed_dims, embed_dims, 3, 1, 1, groups=embed_dims) \
            if cpe1 else None
        self.norm1 = LayerNorm2d(embed_dims)
        self.attn = build_attention(attn_cfg, embed_dims=embed_dims, num_heads=num_heads,
                                    proj_drop=drop_rate, block_idx=block_idx,
                                    stage_idx=stage_idx, pretrain_hw=pretrain_hw)
        self.drop_path = DropPath(drop_path)
        self.cpe2 = nn.Conv2d(embed_dims, embed_dims, 3, 1, 1, groups=embed_dims) \
            if cpe2 else None
        self.norm2 = LayerNorm2d(embed_dims)
        self.ffn = ConvFFN(embed_dims, int(mlp_ratio * embed_dims), drop_rate)
        self.layer_scale = bool(layer_scale_init_value)
        if self.layer_scale:
            self.gamma_1 = nn.Parameter(torch.full((1, embed_dims, 1, 1),
                                                   float(layer_scale_init_value)))
            self.gamma_2 = nn.Parameter(torch.full((1, embed_dims, 1, 1),
                                                   float(layer_scale_init_value)))
        self.ffn_core = check_core(type(self).__name__, 'reference' if drop_rate else 'fast',
                                   FFN_CORES)

    @property
    def takes_rope(self):
        """Whether the mixer takes the stage's shared RoPE (NaLa's own mixers)."""
        return isinstance(self.attn, NaLaMixerBase)

    def _mix(self, x, rope):
        hw = tuple(x.shape[-2:])
        t = nchw_to_nlc(self.norm1(x))
        t = self.attn(t, hw, rope=rope) if self.takes_rope else self.attn(t, hw)
        return nlc_to_nchw(t, hw)

    def ffn_branch(self, x):
        """The ConvFFN branch ``ffn(norm2(x))`` of an NCHW map (see ``ffn_core``)."""
        core = check_core(type(self).__name__, self.ffn_core, FFN_CORES)
        if core == 'fused':
            from linattn_mm.ops.ffn.fused import conv_ffn_branch_fused
            return conv_ffn_branch_fused(x.permute(0, 2, 3, 1), self.norm2.norm,
                                         self.ffn).permute(0, 3, 1, 2)
        if core == 'fast':
            return conv_ffn_branch(x.permute(0, 2, 3, 1), self.norm2.norm,
                                   self.ffn).permute(0, 3, 1, 2)
        return self.ffn(self.norm2(x))

    def cpe(self, conv, x):
        """``x + conv(x)``, a CPE step (see ``ffn_core``)."""
        if self.ffn_core == 'fused':
            from linattn_mm.ops.ffn.fused import conv_residual_fused
            return conv_residual_fused(x, conv)
        return x + conv(x)

    def forward(self, x, rope=None):
        if self.cpe1 is not None:
            x = self.cpe(self.cpe1, x)
        fused = self.ffn_core == 'fused'
        a = self._mix(x, rope)
        x = self.drop_path.add(x, a, self.gamma_1 if self.layer_scale else None, fused)
        if self.cpe2 is not None:
            x = self.cpe(self.cpe2, x)
        f = self.ffn_branch(x)
        return self.drop_path.add(x, f, self.gamma_2 if self.layer_scale else None, fused)


def set_fused_blocks(model, fused):
    """Put the NaLaFormer blocks of ``model`` on ``ffn_core='fused'`` (``fused`` True; blocks
    with dropout keep their plain modules) or back from it to ``'fast'``; returns how many blocks
    are on it. A ``ValueError`` naming a conv the fused kernels do not take, before any block is
    switched."""
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, NaLaBlock)]
    if fused:
        from linattn_mm.ops.ffn.fused import check_fused_conv
        for name, m in blocks:
            for part, conv in (('cpe1', m.cpe1), ('cpe2', m.cpe2), ('ffn.dwconv', m.ffn.dwconv)):
                if conv is not None and m.ffn_core == 'fast':
                    check_fused_conv(f'{name}.{part}', conv)
    for _, m in blocks:
        if fused and m.ffn_core == 'fast':
            m.ffn_core = 'fused'
        elif not fused and m.ffn_core == 'fused':
            m.ffn_core = 'fast'
    return sum(m.ffn_core == 'fused' for _, m in blocks)


class NaLaStage(nn.Module):
    """Blocks of one stage sharing one 2-D RoPE (``RoPE.angle``; only when a block's mixer uses
    it), then optional downsampling. ``forward`` returns ``(stage output, downsampled output)``."""

    def __init__(self, depth, embed_dims, num_heads, attn_cfg, dpr, mlp_ratio,
                 layer_scale_init_value, drop_rate, out_dims, norm_cfg, stage_idx, with_cp,
                 use_cpe=True, pretrain_hw=None):
        super().__init__()
        self.blocks = nn.ModuleList([
            NaLaBlock(embed_dims, num_heads, attn_cfg, mlp_ratio, dpr[j], layer_scale_init_value,
                      drop_rate, block_idx=j, stage_idx=stage_idx, use_cpe=use_cpe,
                      pretrain_hw=pretrain_hw)
            for j in range(depth)])
        uses_rope = any(b.takes_rope and b.attn.use_rope for b in self.blocks)
        self.RoPE = RoPE2d(embed_dims // num_heads, persistent=True) if uses_rope else None
        self.downsample = ConvPatchMerging(embed_dims, out_dims, norm_cfg) if out_dims else None
        self.with_cp = with_cp

    def forward(self, x):
        rope = self.RoPE(x.shape[-2:]) if self.RoPE is not None else None
        for blk in self.blocks:
            if self.with_cp and x.requires_grad:
                x = recomputed(blk, x, rope)
            else:
                x = blk(x, rope)
        down = self.downsample(x) if self.downsample is not None else None
        return x, down


def _arch(dims, depths, heads, ratio, ls, dpr):
    return dict(embed_dims=list(dims), depths=list(depths), num_heads=list(heads),
                mlp_ratios=[ratio] * 4, layer_scale_init_values=list(ls), drop_path_rate=dpr)


@register_backbone
class NaLaFormer(LinAttnBackbone):
    """NaLaFormer backbone (Meng et al., "NaLaFormer: Norm-Aware Linear Attention for Transformer
    Models", arXiv 2506.21137), the hierarchy of the official code.

    A conv stem (stride 4), four stages of blocks (CPE 3x3 depth-wise convs, LayerNorm, attention,
    LayerScale, conv FFN) with conv patch merging (3x3 s2 + BN) between them. As released, stages
    1-2 use norm-aware linear attention (:class:`NormAwareLinearAttention`) and stages 3-4 global
    softmax attention (:class:`NaLaSoftmaxAttention`);
    ``attn_cfg=dict(type='NormAwareLinearAttention')`` gives an all-linear network, and any other
    token mixer fits as well. Every stage shares one 2-D RoPE among its blocks; any H x W input works.

    Args:
        arch (str | dict): ``'xt'``, ``'t'``, ``'s'``, ``'b'``, ``'l'`` (aliases ``x-tiny``,
            ``tiny``, ``small``, ``base``, ``large``) or a dict with ``embed_dims, depths,
            num_heads, mlp_ratios`` (and optionally ``layer_scale_init_values``,
            ``drop_path_rate``). Defaults to ``'t'``.
        in_channels (int): input channels. Defaults to 3.
        attn_cfg (dict | Sequence[dict]): the token mixer of every stage, or one per stage.
            Defaults to :data:`RELEASED_ATTN_CFG`: ``NormAwareLinearAttention`` in stages 1-2 and
            ``NaLaSoftmaxAttention`` in stages 3-4 (the released models). Options go in the
            dicts, e.g. ``dict(type='NormAwareLinearAttention', kernel='paper')``.
        out_indices (Sequence[int]): stages whose maps are returned (before downsampling, each
            through its own LayerNorm ``extra_norms.{i}``). Defaults to ``(0, 1, 2, 3)``. May be
            empty when ``num_classes > 0``.
        num_classes (int): > 0 builds the official classifier (``proj`` Linear to
            ``projection``, BatchNorm ``norm``, SiLU, global average pooling, 1x1 conv ``head``)
            and appends its logits ``(B, num_classes)`` to the outputs (use mmpretrain's
            ``ClsHead``); <= 0 builds none (dense prediction). Defaults to -1.
        projection (int): width of the classifier projection. Defaults to 1024.
        drop_rate (float): dropout in the FFNs and after attention projections. Defaults to 0.
        drop_path_rate (float, optional): stochastic depth, increasing linearly over the blocks;
            ``None`` uses the arch's value (xt/t 0.1, s 0.15, b 0.4, l 0.55). Defaults to None.
        layer_scale_init_values (float | Sequence[float], optional): LayerScale init per stage
            (``None``: the arch's values; 0 disables LayerScale). Defaults to None.
        norm_cfg (dict): BatchNorm of the stem, the patch merging layers and the classifier
            (``BN`` or ``SyncBN``). Defaults to ``dict(type='BN')``.
        with_cp (bool): gradient checkpointing per block. Defaults to False.
        use_cpe (bool | tuple[bool, bool]): build the two CPE depth-wise convs of every block
            (``cpe1`` before the attention, ``cpe2`` before the FFN; a pair turns them on or off
            one by one). They are the official code's; the paper names CPE as its position
            encoding without details. Defaults to True.
        pretrain_img_size (int): classification resolution; mixers with size-dependent
            parameters (e.g. PolaFormer's positional encoding) get the stage grid at this size
            (``pretrain_img_size // 4 // 2**i``) and resize it to the input. NaLa's own mixers
            have none. Defaults to 224.
        frozen_stages (int): freeze the stem and the first ``frozen_stages`` stages (with their
            downsampling and output norms); -1 freezes nothing. Defaults to -1.
        norm_eval (bool): keep the BatchNorm layers in eval mode while training. Defaults to False.
        pretrained (str, optional): deprecated, use ``init_cfg``.
        init_cfg (dict, optional): ``dict(type='Pretrained', checkpoint=...)`` loads official
            NaLaFormer files (``model_ema`` preferred over ``model``), mmpretrain files or raw state
            dicts. Without a classifier, the official ``proj``/``norm``/``head`` keys are dropped.

    The paper's own form (no RoPE, no LePE; its cos/sin kernel; all-linear): ``attn_cfg=dict(
    type='NormAwareLinearAttention', kernel='paper', use_rope=False, use_lepe=False)`` and, to drop
    the code's CPE convs as well, ``use_cpe=False``; see :mod:`linattn_mm.models.attentions.nala`.

    Default init (no checkpoint) is the official one: convs truncated normal (std 0.02, zero bias),
    LayerNorm/BatchNorm ones and zeros, linear layers PyTorch's default.
    """
    arch_zoo = {
        **dict.fromkeys(['xt', 'x-tiny'], _arch((32, 64, 128, 384), (2, 2, 2, 2), (1, 2, 4, 12),
                                               3.5, (1, 1, 1, 1), 0.1)),
        **dict.fromkeys(['t', 'tiny'], _arch((64, 128, 256, 512), (2, 2, 6, 2), (1, 2, 4, 8), 4,
                                             (1, 1, 1, 1), 0.1)),
        **dict.fromkeys(['s', 'small'], _arch((64, 128, 320, 512), (3, 5, 9, 3), (1, 2, 5, 8),
                                              3.5, (1, 1, 1, 1), 0.15)),
        **dict.fromkeys(['b', 'base'], _arch((96, 192, 384, 512), (4, 6, 12, 6), (1, 2, 6, 8), 4,
                                             (1, 1, 1e-6, 1e-6), 0.4)),
        **dict.fromkeys(['l', 'large'], _arch((96, 192, 448, 640), (4, 7, 19, 8), (1, 2, 7, 10),
                                              3.5, (1e-6, 1e-6, 1e-6, 1e-6), 0.55)),
    }

    def __init__(self, arch='t', in_channels=3, attn_cfg=RELEASED_ATTN_CFG,
                 out_indices=(0, 1, 2, 3), num_classes=-1, projection=1024,
                 drop_rate=0., drop_path_rate=None, layer_scale_init_values=None,
                 norm_cfg=dict(type='BN'), with_cp=False, frozen_stages=-1, norm_eval=False,
                 pretrained=None, init_cfg=None, use_cpe=True, pretrain_img_size=224):
        super().__init__(init_cfg, pretrained, frozen_stages, norm_eval)
        self.in_channels = in_channels
        name = type(self).__name__
        a = resolve_arch(name, self.arch_zoo, arch, _ARCH_KEYS)
        self.arch_settings = a
        depths = a['depths']
        self.num_stages = len(depths)
        self.embed_dims = list(a['embed_dims'])
        self.num_features = self.embed_dims
        out_indices = tuple(out_indices)
        if any(i < 0 or i >= self.num_stages for i in out_indices):
            raise ValueError(f'{name}: out_indices {out_indices} must lie in '
                             f'[0, {self.num_stages})')
        if not out_indices and num_classes <= 0:
            raise ValueError(f'{name}: out_indices is empty and there is no classifier '
                             f'(num_classes={num_classes}); nothing to return')
        self.out_indices = out_indices
        self.num_classes = num_classes

        if attn_cfg is RELEASED_ATTN_CFG and self.num_stages != len(RELEASED_ATTN_CFG):
            raise ValueError(f'{name}: the default attn_cfg is the released layout of 4 stages '
                             f'(NaLa in stages 1-2, softmax in 3-4); give attn_cfg (one dict, or '
                             f'one per stage) for an arch of {self.num_stages} stages')
        attn_cfgs = per_stage(name, attn_cfg, self.num_stages)
        _cpe_pair(name, use_cpe)  # a clear error before any block is built
        if layer_scale_init_values is None:
            layer_scale_init_values = a.get('layer_scale_init_values', 1.)
        ls = per_stage(name, layer_scale_init_values, self.num_stages, 'layer_scale_init_values')
        if drop_path_rate is None:
            drop_path_rate = a.get('drop_path_rate', 0.1)
        self.drop_path_rate = drop_path_rate
        dpr = drop_path_rates(drop_path_rate, depths)

        self.patch_embed = ConvStem(in_channels, self.embed_dims[0], norm_cfg)
        self.layers = nn.ModuleList()
        for i in range(self.num_stages):
            self.layers.append(NaLaStage(
                depths[i], self.embed_dims[i], a['num_heads'][i], attn_cfgs[i], dpr[i],
                a['mlp_ratios'][i],
                ls[i], drop_rate,
                self.embed_dims[i + 1] if i < self.num_stages - 1 else None, norm_cfg, i,
                with_cp, use_cpe, (max(1, pretrain_img_size // 4 // 2**i), ) * 2))
        self.extra_norms = nn.ModuleDict(
            {str(i): LayerNorm2d(self.embed_dims[i]) for i in out_indices})
        if num_classes > 0:
            self.projection = projection
            self.proj = nn.Linear(self.embed_dims[-1], projection)
            self.norm = build_bn(norm_cfg, projection)
            self.swish = nn.SiLU()
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.head = nn.Conv2d(projection, num_classes, 1)
            self.pretrained_ignore_keys = ()
        else:
            # classification-only parts of official files
            self.pretrained_ignore_keys = (r'^proj\.', r'^norm\.', r'^head\.')
        self.apply(self.default_init)
        self._freeze_stages()

    @staticmethod
    def default_init(m):
        """The official init: convs truncated normal (std 0.02, zero bias), norms ones/zeros,
        linear layers PyTorch's default."""
        if isinstance(m, nn.Conv2d):
            nn.init.trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.LayerNorm, _BatchNorm)):
            if m.weight is not None:
                nn.init.ones_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            m.reset_parameters()

    def stem_modules(self):
        return [self.patch_embed]

    def stage_modules(self, i):
        mods = [self.layers[i]]
        if str(i) in self.extra_norms:
            mods.append(self.extra_norms[str(i)])
        return mods

    def forward(self, x):
        # channels-last maps: the convs run faster on CPU and the LayerNorms over the channels and
        # the mixers' token views of the maps need no transposing copies
        self.check_image(x)
        x = self.patch_embed(x.contiguous(memory_format=torch.channels_last))
        outs = []
        for i, stage in enumerate(self.layers):
            out, down = stage(x)
            if i in self.out_indices:
                outs.append(self.extra_norms[str(i)](out))
            x = down if down is not None else out
        if self.num_classes > 0:
            y = self.proj(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            y = self.avgpool(self.swish(self.norm(y)))
            outs.append(self.head(y).flatten(1))
        return tuple(outs)
