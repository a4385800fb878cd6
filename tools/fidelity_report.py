"""Fidelity report: every ImageNet variant with a paper table row, built from its config, next to
the paper's parameters, FLOPs and accuracy.

    python tools/fidelity_report.py [--out docs/fidelity.md] [--only NAME ...] [--json F]

For each row the classifier of ``configs/<family>/<name>.py`` is built (mmpretrain, 1000-class head
included) and measured: parameters, and multiply-accumulates at the paper's resolution (224², or
the row's entry in ``ROW_RESOLUTION``) with
:func:`linattn_mm.flops.count_macs`, which counts the attention matmuls ("FLOPs" in the papers are
MACs). A row is flagged when parameters differ by more than 3% or FLOPs by more than 5%; every
flagged row must carry a documented reason (a known paper typo or rounding, or a choice the paper
leaves open), otherwise it is reported as UNEXPLAINED and the tool exits with status 1.
"""
import argparse
import json
import os
import os.path as osp
import sys
import time

import linattn_mm  # noqa: F401
from linattn_mm.flops import config_macs

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
PARAM_TOL, FLOP_TOL = 0.03, 0.05

SET_MT = ("the learnable reference sets (m=500 per block, m·C parameters each) are counted here; without them M / T have 16.39M / 22.71M (+1.2% / +1.8%). The paper's FLOPs lie between this model without the transport matmuls (M 2.09G, T 3.33G) and with them (4.28G / 6.44G): its counter appears to miss part of the attention matmuls (see `docs/model_zoo/setformer.md`)")
SET_SB = ('the paper gives no widths for S / B and no NAT width reproduces its 35.0M / 56.7M '
          '(S / B here follow NAT-S / NAT-B, 39.10M / 69.11M without the reference '
          'sets; of the widths tried, C=80 / MLP 3 gives 35.29M and C=96 / MLP 3.5 56.43M, '
          'docs/model_zoo/setformer.md, "S / B widths"); FLOPs: see setformer-m')

# (config name, paper, params M, GFLOPs, top-1, reason when outside the tolerances)
# Softmax rows are the skeletons' own papers (DeiT, Swin, PVT, PVTv2), the reference the linear
# families are compared against.
ROWS = [
    # ---- softmax skeletons
    ('deit-t_in1k', 'DeiT', 5.7, 1.3, 72.2, None),
    ('deit-s_in1k', 'DeiT', 22.1, 4.6, 79.8, None),
    ('deit-b_in1k', 'DeiT', 86.6, 17.6, 81.8, None),
    ('swin-t_in1k', 'Swin', 28.3, 4.5, 81.3, None),
    ('swin-s_in1k', 'Swin', 49.6, 8.7, 83.0, None),
    ('swin-b_in1k', 'Swin', 87.8, 15.4, 83.5, None),
    ('pvt-t_in1k', 'PVT', 13.2, 1.9, 75.1, None),
    ('pvt-s_in1k', 'PVT', 24.5, 3.8, 79.8, None),
    ('pvt-m_in1k', 'PVT', 44.2, 6.7, 81.2, None),
    ('pvt-l_in1k', 'PVT', 61.4, 9.8, 81.7, None),
    ('pvtv2-b0_in1k', 'PVTv2', 3.4, 0.6, 70.5,
     "the PVTv2 paper's 3.4M for b0 leaves out the 1000-class head (0.26M): the backbone alone "
     'has 3.41M and the official classifier 3.67M (b1-b5 rows include the head); 0.57 GMACs '
     'print as 0.6 with one decimal'),
    ('pvtv2-b1_in1k', 'PVTv2', 14.0, 2.1, 78.7, None),
    ('pvtv2-b2_in1k', 'PVTv2', 25.4, 4.0, 82.0, None),
    ('pvtv2-b3_in1k', 'PVTv2', 45.2, 6.9, 83.2, None),
    ('pvtv2-b4_in1k', 'PVTv2', 62.6, 10.1, 83.6, None),
    ('pvtv2-b5_in1k', 'PVTv2', 82.0, 11.8, 83.8, None),
    # ---- PolaFormer (paper Tables 1 and 5)
    ('pola-pvt-t_in1k', 'PolaFormer', 12, 2.0, 78.8,
     'paper params are truncated (official code: 12.92M, loaded and matched by tests); the '
     'official classes count 2.26 GMACs at 224, the paper prints 2.0G'),
    ('pola-pvt-s_in1k', 'PolaFormer', 21, 4.1, 81.9,
     'paper typo: the official code has 23.16M (even FLatten-PVT-S has 22M); official classes '
     'count 4.47 GMACs'),
    ('pola-swin-t_in1k', 'PolaFormer', 29, 4.5, 82.6, None),
    ('pola-swin-s_in1k', 'PolaFormer', 50, 8.7, 83.6, None),
    ('pola-swin-b_in1k', 'PolaFormer', 88, 15.4, 83.8, None),
    ('pola-pvtv2-b0_in1k', 'PolaFormer', 3.4, 0.6, 72.3,
     'no official code (paper only); 0.64 GMACs print as 0.6 with one decimal. Full-resolution K/V '
     'and no position encoding were chosen because only they give the paper\'s 3.4M / 13M '
     '(with la_sr_ratios 8/4/2/1: 3.87M / 0.60G)'),
    ('pola-pvtv2-b1_in1k', 'PolaFormer', 13, 2.2, 80.2,
     'no official code (paper only); the K/V resolution is not stated. Full-resolution K/V '
     'matches the paper\'s parameters (12.93M vs 13M) at 2.44G; spatially reduced K/V '
     '(la_sr_ratios 8/4/2/1) gives 2.28G but 14.80M: no reading matches both'),
    ('pola-swin-s-384_in1k', 'PolaFormer', 50, 25.5, 84.7,
     'fine-tuned at 384² (counted at 384²). Params: the position encodings sized for the 384 grid '
     '(96x96 / 48x48, the convention of the official Swin-B-384 config) add 1.75M; the paper '
     'prints the 224 row\'s 50M (with the 224 tables resized in every forward the model would '
     'have 50.70M). MACs: this counter already gives Pola-Swin-S 8.91 at 224 against the paper\'s '
     '8.7 (the official classes count the same); no official Swin-S-384 config exists to count'),
    ('pola-deit-t_in1k', 'PolaFormer', 6.1, 1.2, 74.6,
     'not in the official repository (paper only); parameters match (+1.4%). The paper\'s 1.2G '
     'is below softmax DeiT-T (1.25G counted here, 1.3G published) although Pola adds a gate '
     'projection (C -> 4C instead of 3C): its counter cannot have included every linear layer'),
    # ---- NaLaFormer (paper Table 1; Table 6 for the Swin-T protocol)
    ('nalaformer-t_in1k', 'NaLaFormer', 15, 2.7, 82.6,
     'the official code counts 15.9M / 2.86G (analytic count); the paper\'s "15M" is '
     '15.9M truncated'),
    ('nalaformer-s_in1k', 'NaLaFormer', 26, 5.1, 84.3, None),
    ('nalaformer-b_in1k', 'NaLaFormer', 52, 11.8, 85.2, None),
    ('nalaformer-l_in1k', 'NaLaFormer', 95, 17.7, 85.7, None),
    ('nala-swin-t_in1k', 'NaLaFormer', 29, 4.8, 82.9, None),
    # ---- PADRe (paper Table 2)
    ('padre2-deit-t_in1k', 'PADRe', 5, 1.2, 74.5,
     'params: the paper truncates to whole millions (its softmax DeiT-T 5.72M is printed 5); the '
     'default compact layout (3(d-1) point-wise layers and d-1 depth-wise 11x11 convs per mixer) '
     'truncates to every Table 2 figure and reproduces Table 6 (one mixer at 4096 tokens, 2 FLOPs '
     'per MAC). FLOPs: at DeiT-S / B, Table 2 asks at least 2 C^2 MACs per token per block more '
     'than its parameters allow, so no reading matches both (`docs/model_zoo/padre.md`, '
     '"Readings tried")'),
    ('padre3-deit-t_in1k', 'PADRe', 7, 1.7, 76.5,
     'params truncated by the paper; Table 2 FLOPs not reproducible together with its params '
     '(see padre2-deit-t and "Readings tried" in `docs/model_zoo/padre.md`)'),
    ('padre2-deit-s_in1k', 'PADRe', 20, 4.8, 80.4,
     'params truncated by the paper (20.85M prints as 20); Table 2 FLOPs not reproducible '
     'together with its params (see padre2-deit-t and "Readings tried" in '
     '`docs/model_zoo/padre.md`)'),
    ('padre3-deit-s_in1k', 'PADRe', 26, 6.1, 80.5,
     'params truncated by the paper; Table 2 FLOPs not reproducible together with its params '
     '(see padre2-deit-t and "Readings tried" in `docs/model_zoo/padre.md`)'),
    ('padre2-deit-b_in1k', 'PADRe', 80, 18.8, 81.4,
     'params truncated by the paper (its softmax DeiT-B 86.57M is printed 86); Table 2 FLOPs not '
     'reproducible together with its params (see padre2-deit-t and "Readings tried" in '
     '`docs/model_zoo/padre.md`)'),
    # ---- Poly-SA (paper Table 3; it reports attention-only FLOPs, so no model FLOPs here)
    ('poly-swin-t_in1k', 'Poly-SA', 26.1, None, 80.66, None),
    ('poly-deit-t_in1k', 'Poly-SA', 5.4, None, 71.48, None),
    # ---- SeTformer (paper Table 1)
    ('setformer-m_in1k', 'SeTformer', 16.2, 2.8, 81.7, SET_MT),
    ('setformer-t_in1k', 'SeTformer', 22.3, 4.1, 83.9, SET_MT),
    ('setformer-s_in1k', 'SeTformer', 35.0, 6.9, 84.7, SET_SB),
    ('setformer-b_in1k', 'SeTformer', 56.7, 10.2, 86.2, SET_SB),
]


#: rows counted at another square input side than 224 (the paper's resolution for that row)
ROW_RESOLUTION = {
    'pola-swin-s-384_in1k': 384,
}


def find_config(name):
    for fam in sorted(os.listdir(osp.join(REPO, 'configs'))):
        path = osp.join(REPO, 'configs', fam, name + '.py')
        if osp.isfile(path):
            return path
    return None


def rel(ours, paper):
    return None if paper is None else ours / paper - 1


def build_rows(only=None, log=print):
    rows = []
    todo = [r for r in ROWS if not only or r[0] in only]
    for i, (name, paper, p_m, p_g, top1, reason) in enumerate(todo, 1):
        config = find_config(name)
        if config is None:
            rows.append(dict(name=name, paper=paper, missing=True))
            log(f'[{i}/{len(todo)}] {name}: no config')
            continue
        t0 = time.time()
        side = ROW_RESOLUTION.get(name, 224)
        counted = config_macs(config, (side, side))  # the classifier, 1000-class head included
        params, macs = counted['params'], counted['macs']
        d_p, d_f = rel(params / 1e6, p_m), rel(macs / 1e9, p_g)
        flagged = (d_p is not None and abs(d_p) > PARAM_TOL) or \
            (d_f is not None and abs(d_f) > FLOP_TOL)
        rows.append(dict(name=name, paper=paper, config=osp.relpath(config, REPO),
                         resolution=side, params_m=params / 1e6, gmacs=macs / 1e9,
                         paper_params_m=p_m,
                         paper_gflops=p_g, paper_top1=top1, d_params=d_p, d_flops=d_f,
                         flagged=flagged, reason=reason if flagged else None,
                         unexplained=flagged and not reason))
        log(f'[{i}/{len(todo)}] {name}: {params / 1e6:.2f}M, {macs / 1e9:.2f} GMACs at {side}² '
            f'({time.time() - t0:.1f} s)')
    return rows


def _pct(x):
    return '–' if x is None else f'{100 * x:+.1f}%'


def _num(x, fmt):
    return '–' if x is None else format(x, fmt)


def render(rows, command):
    lines = [
        '# Fidelity report',
        '',
        f'Generated by `{command}` (do not edit by hand).',
        '',
        'Every ImageNet variant with a paper table row, built from its config (classifier with '
        'the 1000-class head) and measured here: parameters, and multiply-accumulates at 224² '
        '(another resolution where stated below) '
        'counted with `linattn_mm.flops.count_macs`, which sees every attention matmul ("FLOPs" '
        'in the papers are MACs). The accuracy column is the paper\'s; no ImageNet training is '
        f'possible in this project. Flagged (⚑): parameters off by more than {PARAM_TOL:.0%} '
        f'or FLOPs by more than {FLOP_TOL:.0%}; each flagged row carries its reason.',
        '',
        '| Config | Paper | Params (M) here / paper | Δ | GMACs here / paper | Δ | Paper top-1 '
        '| Flag |',
        '|---|---|---|---|---|---|---|---|',
    ]
    notes = []
    for r in rows:
        if r.get('missing'):
            lines.append(f"| {r['name']} | {r['paper']} | no config | | | | | |")
            continue
        flag = ''
        if r['flagged']:
            notes.append(r)
            flag = '⚑ UNEXPLAINED' if r['unexplained'] else f'⚑ [{len(notes)}]'
        lines.append(
            f"| `{r['config']}` | {r['paper']} | {r['params_m']:.2f} / "
            f"{_num(r['paper_params_m'], 'g')} | {_pct(r['d_params'])} | {r['gmacs']:.2f} / "
            f"{_num(r['paper_gflops'], 'g')} | {_pct(r['d_flops'])} | "
            f"{_num(r['paper_top1'], 'g')} | {flag} |")
    other = [r for r in rows if not r.get('missing') and r['resolution'] != 224]
    if other:
        lines += ['', 'Counted at another resolution (the paper\'s for that row): ' + ', '.join(
            f"`{r['name']}` at {r['resolution']}²" for r in other) + '.']
    if notes:
        lines += ['', '## Reasons for flagged rows', '']
        for i, r in enumerate(notes, 1):
            lines.append(f"{i}. `{r['name']}`: {r['reason'] or 'UNEXPLAINED'}")
    lines += ['', '## Equivalence with the official code', '',
              'Where official code exists, tests pin the outputs of these modules to the official '
              'forward written out from the official code (float64 unless stated):', '']
    lines += [f'- `{t}`: {what}' for t, what in EQUIVALENCE_TESTS]
    return '\n'.join(lines) + '\n'


EQUIVALENCE_TESTS = [
    ('tests/models/test_pola.py', 'PolaLinearAttention (PVT and Swin layouts, class tokens, la_sr_ratio) '
     'against the official order of operations, and official-format files giving the official '
     'logits'),
    ('tests/models/test_nala.py', 'NormAwareLinearAttention and NaLaSoftmaxAttention against the official '
     'kernels (to 1e-6), official `model` / `model_ema` files loading with zero unexpected keys'),
    ('tests/checkpoint/test_backbone_checkpoints.py', 'official Swin / PVT / PVTv2 / DeiT checkpoints in '
     'every format loading with their keys unchanged'),
]


def _learning_check_section(path):
    """The section ``tools/learning_check.py`` wrote into ``path`` (kept across regenerations)."""
    begin, end = '<!-- learning-check:begin -->', '<!-- learning-check:end -->'
    if not osp.exists(path):
        return ''
    text = open(path).read()
    if begin not in text or end not in text:
        return ''
    return text[text.index(begin):text.index(end) + len(end)]


DEFAULT_OUT = osp.join(REPO, 'docs', 'fidelity.md')


def main(argv=None):
    p = argparse.ArgumentParser(description='Params / FLOPs of every variant next to its paper')
    p.add_argument('--out', default=DEFAULT_OUT)
    p.add_argument('--only', nargs='+', help='config names to measure (default: all rows)')
    p.add_argument('--json', help='also write the rows as JSON')
    args = p.parse_args(argv)
    if args.only:
        names = [r[0] for r in ROWS]
        unknown = [n for n in args.only if n not in names]
        if unknown:
            p.error(f'--only: unknown config name(s) {unknown}; the rows: {", ".join(names)}')
        if osp.abspath(args.out) == osp.abspath(DEFAULT_OUT):
            p.error('--only measures some rows: give --out FILE, so that the full table of '
                    'docs/fidelity.md is not replaced by a partial one')
    command = 'python tools/fidelity_report.py' + (
        ' --only ' + ' '.join(args.only) if args.only else '')
    rows = build_rows(args.only)
    text = render(rows, command)
    kept = _learning_check_section(args.out)
    with open(args.out, 'w') as f:
        f.write(text + ('\n' + kept + '\n' if kept else ''))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(rows, f, indent=1)
    bad = [r['name'] for r in rows if r.get('unexplained')]
    print(f'wrote {args.out}: {len(rows)} rows, '
          f"{sum(bool(r.get('flagged')) for r in rows)} flagged, {len(bad)} unexplained"
          + (f': {bad}' if bad else ''))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
