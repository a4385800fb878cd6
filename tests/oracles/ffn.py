"""The first half of the transformer FFN, each step from its definition."""
import math

import torch


def hidden_formula(x, ln_w, ln_b, eps, w1, b1, approximate='none'):
    """``gelu(fc1(layer_norm(x)))`` over the last dim of ``x``, each step from its definition
    (the first half of the transformer FFN, float64 inputs)."""
    mu = x.mean(-1, keepdim=True)
    n = (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps)
    if ln_w is not None:
        n = n * ln_w + ln_b
    h = n @ w1.T + (0 if b1 is None else b1)
    if approximate == 'none':
        return 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))

