"""Attention maps and attention entropy of any backbone built from the zoo.

* :func:`capture_mixer_inputs` runs a model once and records, for every token mixer
  (:class:`~linattn_mm.models.attentions.BaseTokenMixer`), the tokens and grid it was called with.
* :func:`attention_map` gives the weights a mixer's query tokens put on its key tokens: the explicit
  weights where the family has them (softmax, PolaFormer, NaLaFormer, SeTformer: ``attention_weights``
  of the module), otherwise (PADRe, Poly-SA: polynomial mixing without pairwise weights) the
  *influence* ``||d y_i / d x_j||_F`` of input token ``j`` on output token ``i``
  (:func:`influence_map`).
* :func:`attention_entropy` is the mean Shannon entropy of the query rows, the quantity the
  PolaFormer and NaLaFormer papers compare between softmax and linear attention (a low entropy is a
  peaked, selective attention; ``log n`` is uniform).
"""
import math

import torch

from linattn_mm.models.attentions.base import BaseTokenMixer

__all__ = ['find_mixers', 'capture_mixer_inputs', 'influence_map', 'attention_map',
           'attention_entropy', 'query_index']


def find_mixers(model):
    """``[(name, module)]`` of every token mixer in ``model``, in forward order of registration."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTokenMixer)]


@torch.no_grad()
def capture_mixer_inputs(model, *inputs, **kwargs):
    """Run ``model(*inputs, **kwargs)`` once and return ``{name: (x, hw_shape, extra_kwargs)}`` for
    every token mixer that was called (the first call of each). Converted modules
    (:func:`linattn_mm.deploy.convert`) run their plain forms meanwhile, so every mixer's hook
    runs."""
    from linattn_mm.deploy import plain_forms
    records = {}
    handles = []
    for name, mod in find_mixers(model):
        def hook(module, args, kw, name=name):
            if name not in records:
                x, hw = args[0], tuple(args[1] if len(args) > 1 else kw['hw_shape'])
                extra = {k: v for k, v in kw.items() if k != 'hw_shape'}
                records[name] = (x.detach(), hw, extra)
        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with plain_forms(model):
            model(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return records


def query_index(mixer, hw_shape, point):
    """Token index of the grid cell under ``point = (y, x)`` given as fractions of the image
    (0..1), counting the mixer's extra tokens first."""
    H, W = hw_shape
    r = min(int(point[0] * H), H - 1)
    c = min(int(point[1] * W), W - 1)
    return mixer.num_extra_tokens + r * W + c


def influence_map(mixer, x, hw_shape, queries, **kwargs):
    """``(1, 1, Q, N)`` influence of every input token on each query's output token:
    ``||d y_q / d x_j||_F`` over the channels, for sample 0 of ``x``. One Jacobian row block per
    query (``C`` backward passes), so keep ``Q`` small."""
    x0 = x[:1].detach().clone().requires_grad_(True)
    rows = []
    with torch.enable_grad():
        y = mixer(x0, hw_shape, **kwargs)
        eye = torch.eye(y.shape[-1], dtype=y.dtype, device=y.device)
        for qi in queries:
            try:  # all C output channels in one vmapped backward pass
                jac, = torch.autograd.grad(y[0, qi], x0, eye, retain_graph=True,
                                           is_grads_batched=True)
                jac = jac[:, 0]
            except RuntimeError:  # an op without a batching rule: one pass per channel
                jac = torch.stack([torch.autograd.grad(y[0, qi, c], x0, retain_graph=True)[0][0]
                                   for c in range(y.shape[-1])])
            rows.append(jac.pow(2).sum(dim=(0, 2)).sqrt())  # jac: (C_out, N, C_in)
    return torch.stack(rows)[None, None]


@torch.no_grad()
def attention_map(mixer, x, hw_shape, queries=None, **kwargs):
    """Attention of ``mixer`` on tokens ``x`` (sample 0).

    Args:
        mixer (BaseTokenMixer): the module.
        x (Tensor): its input tokens (B, N, C).
        hw_shape (tuple): its grid.
        queries (list[int], optional): query token indices; all queries when None (explicit weights
            only: influence maps need a list).
        **kwargs: extra forward arguments the mixer was called with (e.g. NaLa's ``rope``).

    Returns:
        dict: ``weights`` (h, Q, n) (h = 1 for influence maps), ``key_hw`` (grid of the keys after
        the mixer's extra tokens), ``num_extra`` (extra key tokens first), ``kind`` ('weights' or
        'influence').
    """
    if getattr(mixer, 'has_attention_weights', False):
        out = mixer.attention_weights(x[:1], hw_shape, **kwargs)
        w = out['weights'][0]
        if queries is not None:
            w = w[:, list(queries)]
        return dict(weights=w, key_hw=tuple(out['key_hw']), num_extra=mixer.num_extra_tokens,
                    kind='weights')
    if queries is None:
        raise ValueError(f'{type(mixer).__name__} has no explicit attention weights; its '
                         f'influence map needs a list of query indices')
    w = influence_map(mixer, x, hw_shape, queries, **kwargs)[0]
    return dict(weights=w, key_hw=tuple(hw_shape), num_extra=mixer.num_extra_tokens,
                kind='influence')


def attention_entropy(weights, normalized=False):
    """Mean Shannon entropy (nats) of the rows of ``weights`` (..., Q, n), each row taken as the
    distribution ``|a_ij| / sum_j |a_ij|`` (signed weights such as NaLa's RoPE numerator use their
    magnitude). ``normalized=True`` divides by ``log n`` (1 = uniform)."""
    a = weights.abs().double()
    p = a / a.sum(-1, keepdim=True).clamp_min(1e-300)
    h = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1).mean().item()
    return h / math.log(weights.shape[-1]) if normalized else h
