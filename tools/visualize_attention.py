"""Attention maps of one query token, softmax next to each linear family, and the attention
entropy of every layer.

    python tools/visualize_attention.py [--models NAME|CONFIG ...] [--checkpoints FILE|none ...]
        [--img IMAGE] [--size 224] [--query Y X] [--out-dir work_dirs/attention]
        [--panel 160] [--entropy-queries 4]

For every model, the image is resized to ``--size`` squared, normalised with the ImageNet mean and
std, and passed through the backbone once; every token mixer's input is recorded. Then, per layer:

* the map of the query token under ``--query`` (fractions of the image height / width, default the
  centre): the weights it gives every key token, averaged over the heads, drawn over the image
  (bright = large). Families with explicit weights (softmax, PolaFormer: the mean of its two
  polarity streams, NaLaFormer, SeTformer) draw those; PADRe and Poly-SA mix tokens through
  polynomials and pooling without pairwise weights, so their panels draw the influence
  ``||dy_q/dx_j||`` instead (marked "infl." in the panel title).
* the attention entropy, the mean over heads and queries of the row entropy (all queries for
  explicit weights, ``--entropy-queries`` evenly spaced grid queries for influence maps), in nats
  and divided by ``log n`` (1 = uniform over the n keys).

Writes ``OUT/<model>.png`` (every layer), ``OUT/comparison.png`` (one row per model; the image and
the first layer of each grid size, i.e. of each stage) and ``OUT/entropy.json``, and prints the
entropy table. Without ``--checkpoints`` the models are randomly initialised (the maps then show
what the architecture does before training); pass the ImageNet checkpoints to see trained maps.
Without ``--img`` a deterministic generated image is used.
"""
import argparse
import json
import logging
import math
import os
import os.path as osp

import numpy as np
import torch
from PIL import Image, ImageDraw

import linattn_mm  # noqa: F401
from linattn_mm.analysis import (attention_entropy, attention_map, capture_mixer_inputs,
                                 find_mixers, query_index)

DEFAULT_MODELS = ['swin-t_in1k', 'pola-swin-t_in1k', 'nala-swin-t_in1k', 'padre-swin-t_in1k',
                  'poly-swin-t_in1k', 'setformer-t_in1k']
MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)
LABEL_H = 14  # pixel height of the text band above each panel
MAX_COLS = 6  # panels per row of a model's own figure


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--models', nargs='+', default=DEFAULT_MODELS,
                   help='zoo names (linattn_mm.list_models) or config files')
    p.add_argument('--checkpoints', nargs='+',
                   help="one per model ('none' for random init)")
    p.add_argument('--img', help='image file (default: a generated image)')
    p.add_argument('--size', type=int, default=224, help='square input side')
    p.add_argument('--query', type=float, nargs=2, default=(0.5, 0.5), metavar=('Y', 'X'),
                   help='query position as fractions of the image height and width')
    p.add_argument('--out-dir', default='work_dirs/attention')
    p.add_argument('--panel', type=int, default=160, help='panel side in pixels')
    p.add_argument('--entropy-queries', type=int, default=4,
                   help='queries per layer for the entropy of influence maps')
    p.add_argument('--seed', type=int, default=0, help='seed of the random initialisation')
    args = p.parse_args(argv)
    if args.checkpoints and len(args.checkpoints) != len(args.models):
        p.error(f'--checkpoints needs one entry per model ({len(args.models)}), got '
                f'{len(args.checkpoints)}')
    if not all(0 <= v <= 1 for v in args.query):
        p.error(f'--query takes fractions in [0, 1], got {args.query}')
    return args


def generated_image(size, seed=0):
    """A deterministic RGB test image: a smooth background with a few filled shapes."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    base = np.stack([0.4 + 0.3 * np.sin(3 * xx + c) * np.cos(2 * yy - c) for c in range(3)], -1)
    img = Image.fromarray((base * 255).clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = rng.integers(0, size * 3 // 4, 2)
        r = int(rng.integers(size // 10, size // 4))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse([x0, y0, x0 + r, y0 + r], fill=colour)
        else:
            draw.rectangle([x0, y0, x0 + r, y0 + r], fill=colour)
    return img


def load_image(path, size):
    img = generated_image(size) if path is None else Image.open(path).convert('RGB')
    img = img.resize((size, size), Image.BILINEAR)
    arr = np.asarray(img, dtype=np.float32)
    t = torch.from_numpy((arr - np.array(MEAN, np.float32)) / np.array(STD, np.float32))
    return img, t.permute(2, 0, 1)[None].contiguous()


def _colormap(values):
    """(h, w) in [0, 1] -> (h, w, 3) uint8 (matplotlib's 'inferno')."""
    import matplotlib
    return (matplotlib.colormaps['inferno'](values)[..., :3] * 255).astype(np.uint8)


def _titled_panel(picture, point, panel, title):
    """``picture`` (panel x panel) with the query marked, under a title band: a
    (panel + LABEL_H, panel) RGB image."""
    draw = ImageDraw.Draw(picture)
    cy, cx = point[0] * (panel - 1), point[1] * (panel - 1)
    draw.rectangle([cx - 3, cy - 3, cx + 3, cy + 3], outline=(0, 255, 255), width=2)
    canvas = Image.new('RGB', (panel, panel + LABEL_H), (255, 255, 255))
    canvas.paste(picture, (0, LABEL_H))
    ImageDraw.Draw(canvas).text((2, 1), title[:max(4, panel // 6)], fill=(0, 0, 0))
    return canvas


def render_panel(img, weights, key_hw, point, panel, title):
    """The weights of one query (n,) on the ``key_hw`` grid drawn over ``img``."""
    w = weights.abs().float().reshape(key_hw).numpy()
    w = w / w.max() if w.max() > 0 else w
    heat = Image.fromarray(_colormap(w)).resize((panel, panel), Image.NEAREST)
    base = img.resize((panel, panel), Image.BILINEAR)
    return _titled_panel(Image.blend(base, heat, 0.7), point, panel, title)


def image_panel(img, point, panel, title):
    return _titled_panel(img.resize((panel, panel), Image.BILINEAR), point, panel, title)


def grid_image(panels, cols, panel):
    rows = math.ceil(len(panels) / cols)
    out = Image.new('RGB', (cols * panel, rows * (panel + LABEL_H)), (255, 255, 255))
    for i, p in enumerate(panels):
        out.paste(p, ((i % cols) * panel, (i // cols) * (panel + LABEL_H)))
    return out


def _entropy_queries(mixer, hw, count):
    H, W = hw
    idx = torch.linspace(0, H * W - 1, steps=min(count, H * W)).round().long().tolist()
    return [mixer.num_extra_tokens + i for i in idx]


def analyse_model(name, checkpoint, image, point, entropy_queries, seed=0):
    """Per-layer query maps and entropies of one model: a list of dicts (layer, kind, grid,
    key_grid, map (n_grid,), entropy, normalized_entropy, entropy_queries)."""
    from linattn_mm.apis import get_model
    torch.manual_seed(seed)
    model = get_model(name, pretrained=None if checkpoint in (None, 'none') else checkpoint,
                      convert=False)
    backbone = getattr(model, 'backbone', model)
    mixers = dict(find_mixers(backbone))
    if not mixers:
        raise ValueError(f'{name}: the backbone has no token mixer (BaseTokenMixer) to visualise')
    records = capture_mixer_inputs(backbone, image)
    layers = []
    for lname, (x, hw, kw) in records.items():
        mixer = mixers[lname]
        q = query_index(mixer, hw, point)
        if getattr(mixer, 'has_attention_weights', False):
            full = attention_map(mixer, x, hw, **kw)
            row = full['weights'][:, q]
            ent_w = full['weights']
        else:
            qs = _entropy_queries(mixer, hw, entropy_queries)
            full = attention_map(mixer, x, hw, qs + [q], **kw)
            row = full['weights'][:, -1]
            ent_w = full['weights'][:, :-1]
        e = full['num_extra']
        layers.append(dict(
            layer=lname, mixer=type(mixer).__name__, kind=full['kind'], grid=list(hw),
            key_grid=list(full['key_hw']), map=row.mean(0)[e:],
            entropy=attention_entropy(ent_w), normalized_entropy=attention_entropy(
                ent_w, normalized=True), entropy_queries=ent_w.shape[-2]))
    return layers


def stage_firsts(layers):
    """Indices of the first layer of each grid size (the first block of each stage)."""
    seen, out = set(), []
    for i, lay in enumerate(layers):
        if tuple(lay['grid']) not in seen:
            seen.add(tuple(lay['grid']))
            out.append(i)
    return out


def _short(layer):
    return layer.replace('stages.', 's').replace('blocks.', 'b').replace('layers.', 'l').replace(
        '.attn', '')


def main(argv=None):
    args = parse_args(argv)
    from mmengine.logging import MMLogger
    MMLogger.get_current_instance().setLevel(logging.WARNING)  # no per-parameter init report
    os.makedirs(args.out_dir, exist_ok=True)
    img, tensor = load_image(args.img, args.size)
    ckpts = args.checkpoints or [None] * len(args.models)
    results, rows = {}, []
    n_cols = None
    for name, ckpt in zip(args.models, ckpts):
        layers = analyse_model(name, ckpt, tensor, args.query, args.entropy_queries, args.seed)
        tag = osp.splitext(osp.basename(name))[0]
        panels = [image_panel(img, args.query, args.panel, tag)]
        for lay in layers:
            mark = ' infl.' if lay['kind'] == 'influence' else ''
            panels.append(render_panel(img, lay['map'], lay['key_grid'], args.query, args.panel,
                                       f"{_short(lay['layer'])}{mark}"))
        grid_image(panels, min(MAX_COLS, len(panels)), args.panel).save(
            osp.join(args.out_dir, f'{tag}.png'))
        firsts = stage_firsts(layers)
        rows.append([panels[0]] + [panels[1 + i] for i in firsts])
        n_cols = max(n_cols or 0, len(rows[-1]))
        results[tag] = [{k: v for k, v in lay.items() if k != 'map'} for lay in layers]
        print(f'{tag}: {len(layers)} layers')
        for lay in layers:
            print(f"  {lay['layer']:<32} {lay['mixer']:<26} {lay['kind']:<9} grid "
                  f"{lay['grid'][0]}x{lay['grid'][1]}  entropy {lay['entropy']:.3f} nats "
                  f"({lay['normalized_entropy']:.3f} of uniform)")
    blank = Image.new('RGB', (args.panel, args.panel + LABEL_H), (255, 255, 255))
    flat = [p for r in rows for p in r + [blank] * (n_cols - len(r))]
    grid_image(flat, n_cols, args.panel).save(osp.join(args.out_dir, 'comparison.png'))
    with open(osp.join(args.out_dir, 'entropy.json'), 'w') as f:
        json.dump(dict(image=args.img or 'generated', size=args.size, query=list(args.query),
                       models=results), f, indent=1)
    print(f'wrote {len(rows) + 2} files to {args.out_dir}')
    return results


if __name__ == '__main__':
    main()
