"""The pyramid every skeleton must return: grid sizes of its four maps for an input size, and a
check of a model's maps (sizes, channels, finite values)."""
import math

import torch


def expected_pyramid_hw(H, W, plain_vit=False):
    """Output grid sizes of a skeleton for an H x W input: strides 4, 8, 16, 32 with ceil
    rounding (padding), or for the plain ViT the stride-16 grid g mapped to 4g, 2g, g, ceil(g/2)."""
    if plain_vit:
        h, w = math.ceil(H / 16), math.ceil(W / 16)
        return [(4 * h, 4 * w), (2 * h, 2 * w), (h, w), (math.ceil(h / 2), math.ceil(w / 2))]
    return [(math.ceil(H / s), math.ceil(W / s)) for s in (4, 8, 16, 32)]


def assert_pyramid_outputs(model, size, channels, plain_vit=False):
    """Run ``model`` (eval, no grad) on a 1x3xHxW input and check the four maps: grid sizes
    (:func:`expected_pyramid_hw`), channels and finiteness."""
    torch.manual_seed(0)
    with torch.no_grad():
        outs = model.eval()(torch.randn(1, 3, *size))
    assert [tuple(o.shape[-2:]) for o in outs] == expected_pyramid_hw(*size, plain_vit=plain_vit)
    assert [o.shape[1] for o in outs] == list(channels)
    assert all(torch.isfinite(o).all() for o in outs)

