"""Shared behaviour of linattn_mm backbones: arch zoo lookup, per-stage attention configs,
standard mm backbone arguments (frozen_stages, norm_eval, init_cfg/pretrained) and checkpoint
loading through :func:`linattn_mm.checkpoint.load_pretrained`."""
import copy
import math
import warnings

import torch
import torch.nn as nn
from mmengine.model import BaseModule
from torch.nn.modules.batchnorm import _BatchNorm

from linattn_mm.models.attentions.base import BaseTokenMixer


def resolve_arch(cls_name, arch_zoo, arch, required_keys):
    """Return the arch settings for ``arch`` (a zoo name or a dict of settings). In a dict with
    ``depths``, every other list is per stage and must have one entry per stage."""
    if isinstance(arch, str):
        key = arch.lower()
        if key not in arch_zoo:
            raise KeyError(f'{cls_name}: unknown arch {arch!r}; valid archs: '
                           f'{", ".join(sorted(arch_zoo))} (or a dict with keys '
                           f'{sorted(required_keys)})')
        return copy.deepcopy(arch_zoo[key])
    if not isinstance(arch, dict):
        raise TypeError(f'{cls_name}: arch must be a name or a dict, got {type(arch).__name__}')
    missing = set(required_keys) - set(arch)
    if missing:
        raise KeyError(f'{cls_name}: custom arch is missing {sorted(missing)}; '
                       f'required keys: {sorted(required_keys)}')
    depths = arch.get('depths')
    if isinstance(depths, (list, tuple)):
        for key, value in arch.items():
            if isinstance(value, (list, tuple)) and len(value) != len(depths):
                raise ValueError(f'{cls_name}: arch {key} has {len(value)} entries for '
                                 f'{len(depths)} stages (depths={list(depths)})')
    return copy.deepcopy(dict(arch))


def per_stage(cls_name, value, num_stages, what='attn_cfg'):
    """Expand one config to every stage, or check a per-stage list has the right length."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_stages:
            raise ValueError(f'{cls_name}: {what} has {len(value)} entries but the arch has '
                             f'{num_stages} stages')
        return [copy.deepcopy(v) for v in value]
    return [copy.deepcopy(value) for _ in range(num_stages)]


def drop_path_rates(drop_path_rate, depths):
    """Linearly increasing stochastic depth over all blocks, split per stage."""
    total = sum(depths)
    rates = [drop_path_rate * i / max(total - 1, 1) for i in range(total)]
    out, start = [], 0
    for d in depths:
        out.append(rates[start:start + d])
        start += d
    return out


def init_transformer_weights(m):
    """Default init of the official PVT v1, Swin and DeiT code (and of PolaFormer's, which
    inherits it): trunc-normal(0.02) linears with zero bias, unit norms. Convolutions keep
    PyTorch's default init, as the official ``_init_weights`` never touches them."""
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, (nn.LayerNorm, nn.GroupNorm, _BatchNorm)):
        if m.weight is not None:
            nn.init.ones_(m.weight)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


def init_transformer_weights_fan_out(m):
    """Default init of the official PVTv2 code: :func:`init_transformer_weights` plus
    fan-out normal convolutions, ``N(0, 2 / (k_h k_w C_out / groups))``, with zero bias."""
    init_transformer_weights(m)
    if isinstance(m, nn.Conv2d):
        fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
        nn.init.normal_(m.weight, 0, math.sqrt(2.0 / fan_out))
        if m.bias is not None:
            nn.init.zeros_(m.bias)


class LinAttnBackbone(BaseModule):
    """Base of every linattn_mm backbone.

    Subclasses set ``self.num_stages`` and implement ``stage_modules(i)`` (modules of stage ``i``,
    0-based) and ``stem_modules()`` (modules before stage 0) for ``frozen_stages``.
    """

    #: regexes of checkpoint keys that are dropped (and reported) when loading pretrained weights
    pretrained_ignore_keys = ()
    #: per-module initialisation applied by ``init_weights`` (the official code's of the family)
    default_init = staticmethod(init_transformer_weights)

    def __init__(self, init_cfg=None, pretrained=None, frozen_stages=-1, norm_eval=False):
        if pretrained is not None:
            if init_cfg is not None:
                raise ValueError('init_cfg and pretrained cannot both be set')
            if not isinstance(pretrained, str):
                raise TypeError(f'pretrained must be a str or None, got {type(pretrained).__name__}')
            warnings.warn('pretrained is deprecated; use init_cfg=dict(type="Pretrained", '
                          'checkpoint=...)', DeprecationWarning)
            init_cfg = dict(type='Pretrained', checkpoint=pretrained)
        super().__init__(init_cfg=init_cfg)
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval

    # --- weights -------------------------------------------------------------------------------
    def _pretrained_cfg(self):
        cfg = self.init_cfg
        if isinstance(cfg, (list, tuple)):
            cfg = next((c for c in cfg if c.get('type') == 'Pretrained'), None)
        if isinstance(cfg, dict) and cfg.get('type') == 'Pretrained':
            return cfg
        return None

    def init_weights(self):
        """Per-module ``default_init`` (the family's official init), then the mixers' own
        ``init_weights``, then the ``Pretrained`` checkpoint (if any) through :func:`linattn_mm.checkpoint.load_pretrained`,
        which unwraps official / mmpretrain / raw files, resizes size-dependent tensors and
        reports missing and unexpected keys."""
        self.apply(self.default_init)
        pre = self._pretrained_cfg()
        if pre is not None:
            unknown = set(pre) - {'type', 'checkpoint', 'prefix', 'map_location',
                                  'allow_unsafe_pickle', 'prefer_ema', 'strict', 'min_loaded'}
            if unknown:
                raise KeyError(f'unknown Pretrained init_cfg option(s) {sorted(unknown)}; valid: '
                               'checkpoint, prefix, map_location, allow_unsafe_pickle, '
                               'prefer_ema, strict, min_loaded')
        saved = self.init_cfg
        if pre is not None:
            rest = [c for c in (saved if isinstance(saved, (list, tuple)) else [saved])
                    if c is not pre]
            self.init_cfg = rest or None
        try:
            super().init_weights()
        finally:
            self.init_cfg = saved
        # mmengine only recurses through BaseModule children; token mixers sit inside plain
        # ModuleLists, so run their own (official) initialisation here.
        for m in self.modules():
            if isinstance(m, BaseTokenMixer) and \
                    type(m).init_weights is not BaseModule.init_weights:
                m.init_weights()
        if pre is None:
            return
        from linattn_mm.checkpoint import load_pretrained
        self.pretrained_load_report = load_pretrained(
            self, pre['checkpoint'], prefix=pre.get('prefix'),
            map_location=pre.get('map_location', 'cpu'),
            allow_unsafe_pickle=pre.get('allow_unsafe_pickle'),
            prefer_ema=pre.get('prefer_ema', True), strict=pre.get('strict', False),
            min_loaded=pre.get('min_loaded', 0.5))

    # --- input -------------------------------------------------------------------------------
    def check_image(self, x):
        """A clear error for an input that is not a batch of ``in_channels``-channel images
        ``(B, C, H, W)`` (the layers would fail later with less telling errors)."""
        name = type(self).__name__
        want = getattr(self, 'in_channels', None)
        if not torch.is_tensor(x) or x.dim() != 4:
            got = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
            raise ValueError(f'{name} takes a batch of images (B, {want or "C"}, H, W), got '
                             f'{got}')
        if want is not None and x.shape[1] != want:
            raise ValueError(f'{name} was built for {want}-channel images (in_channels={want}), '
                             f'got {x.shape[1]} channels: input {tuple(x.shape)}')

    # --- freezing ------------------------------------------------------------------------------
    def stem_modules(self):
        return []

    def stage_modules(self, i):
        raise NotImplementedError

    def _freeze_stages(self):
        if self.frozen_stages < 0:
            return
        if self.frozen_stages > self.num_stages:
            raise ValueError(f'frozen_stages={self.frozen_stages} exceeds the '
                             f'{self.num_stages} stages')
        groups = list(self.stem_modules())
        for i in range(self.frozen_stages):
            groups += list(self.stage_modules(i))
        for m in groups:
            if isinstance(m, nn.Parameter):
                m.requires_grad = False
                continue
            m.eval()
            for p in m.parameters():
                p.requires_grad = False

    def train(self, mode=True):
        super().train(mode)
        self._freeze_stages()
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, _BatchNorm):
                    m.eval()
        return self
