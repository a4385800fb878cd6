"""ResNet-50/101 with Poly-NL blocks placed between residual blocks (the Poly-NL paper's ImageNet and
COCO networks: one block right before the last residual block of res4).

The ResNet part has the module names of torchvision / mmpretrain / mmdet ResNets (``conv1``,
``bn1``, ``layer{1-4}.{j}.{conv,bn}{1-3}``, ``layer{i}.0.downsample.{0,1}``), so their ImageNet
files load unchanged. A Poly-NL block is a separate module (``polynl_layer3_5`` for the default
placement), not inserted into ``layer3``, so no ResNet key moves and the only missing keys of a stock
ResNet file are the Poly-NL ones. With ``beta = 0`` (its initial value) the network computes exactly
the stock ResNet.
"""
import math

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from linattn_mm.ops.lean_layers import recomputed
from linattn_mm.registry import register_backbone
from ..attentions.poly import PolyNL2d
from ..utils.layers import build_bn
from .base import LinAttnBackbone


class Bottleneck(nn.Module):
    """ResNet bottleneck (expansion 4), ``style='pytorch'`` (stride on the 3x3 conv, ResNet v1.5 as
    torchvision / mmdet default) or ``'caffe'`` (stride on the first 1x1 conv)."""
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None, style='pytorch',
                 norm_cfg=dict(type='BN'), with_cp=False):
        super().__init__()
        s1, s2 = (1, stride) if style == 'pytorch' else (stride, 1)
        self.conv1 = nn.Conv2d(inplanes, planes, 1, s1, bias=False)
        self.bn1 = build_bn(norm_cfg, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, s2, 1, bias=False)
        self.bn2 = build_bn(norm_cfg, planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = build_bn(norm_cfg, planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.with_cp = with_cp

    def _inner(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return out + identity

    def forward(self, x):
        if self.with_cp and x.requires_grad:
            out = recomputed(self._inner, x)
        else:
            out = self._inner(x)
        return self.relu(out)


def init_resnet_weights(m):
    """Kaiming-normal (fan-out, ReLU) convs, unit BatchNorms: the torchvision / mmdet ResNet
    init. Poly-NL's alpha / beta are parameters of their block, not touched here."""
    if isinstance(m, nn.Conv2d):
        nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, (_BatchNorm, nn.GroupNorm)):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, 0, 0.01)
        nn.init.zeros_(m.bias)


def valid_mask_from_padding(img, feat_hw):
    """Valid-region mask (B, 1, h, w) of a feature map from a batch of images zero-padded at the
    bottom / right (mmdet / mmseg data preprocessors pad after normalisation with 0): the valid
    extent of every image is up to its last row / column holding a non-zero value, mapped to the
    feature grid with ceil rounding."""
    B, _, H, W = img.shape
    h, w = feat_hw
    nz = img.detach().ne(0).any(dim=1)  # (B, H, W)
    rows = nz.any(dim=2)
    cols = nz.any(dim=1)
    ar_h = torch.arange(1, H + 1, device=img.device)
    ar_w = torch.arange(1, W + 1, device=img.device)
    vh = (rows * ar_h).amax(dim=1)  # last non-zero row (1-based), 0 for an all-zero image
    vw = (cols * ar_w).amax(dim=1)
    vh = torch.where(vh == 0, torch.full_like(vh, H), vh)
    vw = torch.where(vw == 0, torch.full_like(vw, W), vw)
    fh = torch.ceil(vh.float() * h / H).long().clamp(1, h)
    fw = torch.ceil(vw.float() * w / W).long().clamp(1, w)
    mask_h = torch.arange(h, device=img.device)[None] < fh[:, None]
    mask_w = torch.arange(w, device=img.device)[None] < fw[:, None]
    return (mask_h[:, :, None] & mask_w[:, None, :]).unsqueeze(1)


@register_backbone
class PolyNLResNet(LinAttnBackbone):
    """ResNet with Poly-NL blocks between residual blocks (paper: ResNet-50 + one Poly-NL with
    reduction 4 right before the last block of res4).

    Args:
        depth (int): 50 or 101.
        in_channels (int): input channels. Default 3.
        polynl_cfg (dict): options of :class:`~linattn_mm.models.attentions.PolyNL2d`
            (``reduction``, ``order``, ``alpha_init``, ``beta_init``, ``bias``, ``fp32``).
            Default ``dict(reduction=4)``.
        polynl_positions (list[tuple[int, int]]): ``(stage, block)`` pairs; a Poly-NL block is
            applied to the input of block ``block`` of stage ``stage`` (0-based: stage 2 = res4;
            negative block indices count from the end). Default ``[(2, -1)]``, the paper's
            placement. Module names: ``polynl_layer{stage+1}_{block}``.
        pad_mask (str | None): ``'infer'`` (default): the valid region of every image of a
            zero-padded batch is inferred from the input (its last non-zero row / column) and
            Poly-NL averages over it only; None: every position counts (classification crops).
        out_indices (tuple[int]): stages to return (0-3). Default (0, 1, 2, 3).
        style (str): ``'pytorch'`` (stride on the 3x3 conv, default) or ``'caffe'``.
        norm_cfg (dict): BatchNorm config (``BN`` / ``SyncBN``, ``requires_grad``...).
        frozen_stages (int): -1: none; 0: the stem; k: stem and stages 1..k (mmdet semantics).
        norm_eval (bool): keep BatchNorms in eval mode while training. Default False.
        zero_init_residual (bool): zero the last BN of each residual block at init. Default True.
        with_cp (bool): gradient checkpointing of the residual blocks.
        pretrained, init_cfg: weights (``init_cfg=dict(type='Pretrained', checkpoint=...)``:
            torchvision / mmpretrain / mmdet ResNet files load with only the Poly-NL keys missing).
    """
    arch_zoo = {50: dict(depths=[3, 4, 6, 3]), 101: dict(depths=[3, 4, 23, 3])}
    default_init = staticmethod(init_resnet_weights)
    pretrained_ignore_keys = (r'^fc\.', r'^head\.')

    def __init__(self, depth=50, in_channels=3, polynl_cfg=None, polynl_positions=((2, -1), ),
                 pad_mask='infer', out_indices=(0, 1, 2, 3), style='pytorch',
                 norm_cfg=dict(type='BN', requires_grad=True), frozen_stages=-1, norm_eval=False,
                 zero_init_residual=True, with_cp=False, pretrained=None, init_cfg=None):
        super().__init__(init_cfg, pretrained, frozen_stages, norm_eval)
        self.in_channels = in_channels
        name = type(self).__name__
        if depth not in self.arch_zoo:
            raise KeyError(f'{name}: unsupported depth {depth}; valid: {sorted(self.arch_zoo)}')
        if style not in ('pytorch', 'caffe'):
            raise ValueError(f"{name}: style must be 'pytorch' or 'caffe', got {style!r}")
        if pad_mask not in ('infer', None):
            raise ValueError(f"{name}: pad_mask must be 'infer' or None, got {pad_mask!r}")
        depths = self.arch_zoo[depth]['depths']
        self.depth = depth
        self.num_stages = 4
        out_indices = tuple(out_indices)
        if not out_indices or any(i < 0 or i > 3 for i in out_indices):
            raise ValueError(f'{name}: out_indices {out_indices} must lie in [0, 4)')
        self.out_indices = out_indices
        self.pad_mask = pad_mask
        self.zero_init_residual = zero_init_residual
        self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
        self.bn1 = build_bn(norm_cfg, 64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inplanes = 64
        self.num_features = []
        for i, n in enumerate(depths):
            planes = 64 * 2**i
            stride = 1 if i == 0 else 2
            down = None
            if stride != 1 or inplanes != planes * 4:
                down = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride, bias=False),
                                     build_bn(norm_cfg, planes * 4))
            blocks = [Bottleneck(inplanes, planes, stride, down, style, norm_cfg, with_cp)]
            inplanes = planes * 4
            blocks += [Bottleneck(inplanes, planes, 1, None, style, norm_cfg, with_cp)
                       for _ in range(1, n)]
            self.add_module(f'layer{i + 1}', nn.Sequential(*blocks))
            self.num_features.append(inplanes)
        # Poly-NL blocks: {stage: {block index: module name}}
        self.polynl_at = {}
        cfg = dict(reduction=4)
        cfg.update(polynl_cfg or {})
        for stage, block in polynl_positions:
            if not 0 <= stage < 4:
                raise ValueError(f'{name}: polynl stage {stage} must lie in [0, 4)')
            n = depths[stage]
            if not -n <= block < n:
                raise ValueError(f'{name}: polynl block {block} out of range for stage {stage} '
                                 f'with {n} blocks')
            block %= n
            channels = getattr(self, f'layer{stage + 1}')[block].conv1.in_channels
            mod_name = f'polynl_layer{stage + 1}_{block}'
            if mod_name in dict(self.named_children()):
                raise ValueError(f'{name}: Poly-NL position {(stage, block)} given twice')
            self.add_module(mod_name, PolyNL2d(channels, **cfg))
            self.polynl_at.setdefault(stage, {})[block] = mod_name
        self._freeze_stages()

    def init_weights(self):
        super().init_weights()
        if self.zero_init_residual and self._pretrained_cfg() is None:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)

    def stem_modules(self):
        return [self.conv1, self.bn1]

    def stage_modules(self, i):
        mods = [getattr(self, f'layer{i + 1}')]
        mods += [getattr(self, n) for n in self.polynl_at.get(i, {}).values()]
        return mods

    def forward(self, x):
        self.check_image(x)
        img = x
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        outs = []
        for i in range(4):
            layer = getattr(self, f'layer{i + 1}')
            spots = self.polynl_at.get(i, {})
            for j, blk in enumerate(layer):
                if j in spots:
                    mask = None
                    if self.pad_mask == 'infer':
                        mask = valid_mask_from_padding(img, x.shape[-2:])
                        if bool(mask.all()):
                            mask = None
                    x = getattr(self, spots[j])(x, valid_mask=mask)
                x = blk(x)
            if i in self.out_indices:
                outs.append(x)
        return tuple(outs)


def resnet_output_hw(H, W):
    """Output grid sizes of the four ResNet stages for an H x W input."""
    sizes = []
    h, w = math.floor((H + 6 - 7) / 2) + 1, math.floor((W + 6 - 7) / 2) + 1
    h, w = math.floor((h + 2 - 3) / 2) + 1, math.floor((w + 2 - 3) / 2) + 1
    for i in range(4):
        if i:
            h, w = math.floor((h + 2 - 3) / 2) + 1, math.floor((w + 2 - 3) / 2) + 1
        sizes.append((h, w))
    return sizes


__all__ = ['PolyNLResNet', 'Bottleneck', 'valid_mask_from_padding', 'resnet_output_hw']
