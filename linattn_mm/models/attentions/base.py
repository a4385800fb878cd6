"""The token-mixer interface shared by every attention family.

A token mixer maps tokens ``x`` of shape ``(B, N, C)`` laid out row-major on a grid ``hw_shape = (H, W)``
to tokens of the same shape. ``N == num_extra_tokens + H * W``: extra tokens (a ViT/DeiT class
token) come first and are not part of the grid.

Skeletons build their mixers with :func:`build_attention`, passing a *context*: facts about the place
the mixer sits in (``embed_dims``, ``num_heads``, ``block_idx``, ``pretrain_hw``, ...). Each context
entry is passed only when the mixer's ``__init__`` accepts it, so one skeleton can host any family.
Options the user writes in the attention config are always passed, so a misspelt option is an error
that lists the valid ones.
"""
import copy
import inspect

import torch
import torch.nn as nn
from mmengine.model import BaseModule

from linattn_mm.ops.common import autocast_on, no_autocast
from linattn_mm.registry import ATTENTIONS


class BaseTokenMixer(BaseModule):
    """Base class of every attention module.

    Subclasses implement ``forward(x, hw_shape)`` with ``x: (B, N, C)`` and return ``(B, N, C)``.

    Args:
        embed_dims (int): channels C.
        num_heads (int): number of heads.
        num_extra_tokens (int): tokens before the grid (e.g. 1 for a class token). Default 0.
        init_cfg (dict, optional): mmengine init config.
    """

    #: True if the module can take extra (non-grid) tokens such as a class token.
    supports_extra_tokens = True

    def __init__(self, embed_dims, num_heads, num_extra_tokens=0, init_cfg=None):
        super().__init__(init_cfg=init_cfg)
        if embed_dims % num_heads != 0:
            raise ValueError(f'{type(self).__name__}: embed_dims={embed_dims} is not divisible by '
                             f'num_heads={num_heads}')
        if num_extra_tokens and not self.supports_extra_tokens:
            raise ValueError(f'{type(self).__name__} does not support extra (class) tokens; '
                             f'num_extra_tokens={num_extra_tokens}')
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.head_dims = embed_dims // num_heads
        self.num_extra_tokens = num_extra_tokens

    def check_input(self, x, hw_shape):
        H, W = hw_shape
        if x.dim() != 3 or x.shape[1] != self.num_extra_tokens + H * W or x.shape[2] != self.embed_dims:
            raise ValueError(
                f'{type(self).__name__}: expected tokens (B, {self.num_extra_tokens}+{H}*{W}, '
                f'{self.embed_dims}) for hw_shape={tuple(hw_shape)}, got {tuple(x.shape)}')

    def forward(self, x, hw_shape):  # pragma: no cover - interface
        raise NotImplementedError

    #: True if :meth:`attention_weights` gives the mixer's explicit token-to-token weights.
    has_attention_weights = False

    def attention_weights(self, x, hw_shape):
        """The token-to-token weights ``A`` the mixer applies to its values, for analysis.

        Returns a dict with ``weights`` (B, h, N, n): row ``i`` holds the weights query token ``i``
        gives the ``n`` key tokens (extra tokens first, then the key grid row-major), and
        ``key_hw``, the key grid (the query grid, or a reduced one). Families without pairwise
        weights (a polynomial or pooled mixing) do not implement it; use
        :func:`linattn_mm.analysis.influence_map` for them. Dense: meant for small inputs.
        """
        raise NotImplementedError(
            f'{type(self).__name__} has no explicit token-to-token attention weights; use '
            f'linattn_mm.analysis.influence_map')


def run_in_fp32(fn, x, *args, enabled=True, **kwargs):
    """``fn(x, *args, **kwargs)``; when ``enabled`` and autocast is on for ``x``'s device, with
    autocast disabled and ``x`` cast to float32 (the result then stays float32: the residual stream
    of the skeletons is float32 under autocast). Mixers whose products or sums over tokens can
    leave the float16 range use this for their core."""
    if enabled and autocast_on(x.device):
        with no_autocast(x.device):
            return fn(x.float(), *args, **kwargs)
    return fn(x, *args, **kwargs)


def split_heads(t, num_heads):
    """(B, N, C) -> (B, h, N, C/h)."""
    B, N, C = t.shape
    return t.reshape(B, N, num_heads, C // num_heads).transpose(1, 2)


def merge_heads(t):
    """(B, h, N, d) -> (B, N, h*d)."""
    B, h, N, d = t.shape
    return t.transpose(1, 2).reshape(B, N, h * d)


#: options of earlier versions -> what replaces them (named in the error of a config using them)
RENAMED_OPTIONS = {
    'fused': "core ('fast', 'reference', 'fused' or 'triton'), which chooses the kernels; the "
             'inference forms of whole layers that fused=True chose come from '
             "linattn_mm.deploy.convert(model), not from core='fused' (a training core for CUDA)",
}


def _init_params(cls):
    sig = inspect.signature(cls.__init__)
    names = []
    var_kw = False
    for name, p in list(sig.parameters.items())[1:]:
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            var_kw = True
        elif p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.append(name)
    return names, var_kw


def build_attention(cfg, **context):
    """Build a token mixer from ``cfg`` (a dict with ``type``) and the skeleton's ``context``.

    ``context`` entries (e.g. ``embed_dims``, ``num_heads``, ``block_idx``) are passed only where the
    mixer's constructor takes them; entries given in ``cfg`` win over context. Unknown ``type`` or
    options raise an error that lists the valid names.
    """
    if isinstance(cfg, nn.Module):
        return cfg
    if not isinstance(cfg, dict) or 'type' not in cfg:
        raise TypeError(f'attention config must be a dict with a "type" key, got {cfg!r}')
    cfg = copy.deepcopy(dict(cfg))
    type_name = cfg.pop('type')
    cls = type_name if inspect.isclass(type_name) else ATTENTIONS.get(type_name)
    if cls is None:
        valid = ', '.join(sorted(ATTENTIONS.module_dict))
        raise KeyError(f'unknown attention type {type_name!r}; valid types: {valid}')
    names, var_kw = _init_params(cls)
    unknown = [k for k in cfg if k not in names]
    if unknown and not var_kw:
        hints = ''.join(f"; '{k}' is now {RENAMED_OPTIONS[k]}" for k in unknown
                        if k in RENAMED_OPTIONS)
        raise TypeError(f'{cls.__name__} got unknown option(s) {unknown}; valid options: '
                        f'{", ".join(n for n in names if n not in ("init_cfg",))}{hints}')
    if context.get('num_extra_tokens') and (
            'num_extra_tokens' not in names or not getattr(cls, 'supports_extra_tokens', True)):
        raise ValueError(f'{cls.__name__} does not support extra (class) tokens, but the skeleton '
                         f'has num_extra_tokens={context["num_extra_tokens"]} (e.g. use '
                         f'with_cls_token=False)')
    kwargs = {k: v for k, v in context.items() if k in names and k not in cfg}
    kwargs.update(cfg)
    return cls(**kwargs)


def list_attentions():
    """Names of every registered token mixer."""
    return sorted(ATTENTIONS.module_dict)
