"""Counts of the readings of PADRe's per-degree modules against the paper (docs/model_zoo/padre.md,
"Readings tried").

    python tools/padre_readings.py [--rows T-2 T-3 ...] [--degrees 2 3 4] [--json FILE]

The paper fixes the framework (Y_i = A_i X B_i, Z_1 = Y_1, Z_{i+1} = (C_i Z_i D_i) ⊙ Y_{i+1}, an
output over Z_2..Z_d) but not which A_i, B_i, C_i, D_i exist per degree. Each reading is built as a
module and counted: the parameters of the PADRe-DeiT classifiers of Table 2 (224², 1000-way head,
``cls_mode='pool'`` pairs included; parameter sums) and the multiply-accumulates of one mixer at
4096 tokens (64×64), width 192 (Table 6, whose FLOPs are 2 × MACs; ``linattn_mm.flops.count_macs``).
"PW / DW" is the number of point-wise C×C layers / depth-wise 11×11 convs per mixer (checked
against the modules, as are the MACs: one C² per point-wise and 121·C per depth-wise layer and
token). The readings:

* compact: ``PADReMixer(layout='compact')`` (the default): Z_1 = X, Y_i = X B_i, C_i / D_i on every
  Z_i, per-degree output W_i;
* full: ``PADReMixer(layout='full')``: every A_i, B_i, C_i, D_i, per-channel w_i, one projection;
* full without D_i: token mixing only on Z_i (same counts: one B shared by all Y_i);
* full without C_i: channel mixing only on Z_i;
* no C_i, D_i: Z_{i+1} = Z_i ⊙ Y_{i+1} (same counts: one Y = A X B with per-degree C_i, D_i);
* A on Y_1 only, no C_i, D_i: Conv2Former (the paper's App. B.2) continued by products;
* full with C_i, D_i shared across degrees;
* A, B, C, D all shared across degrees (one Y, one C, one D);
* full with per-degree output 1×1 convs (Eq. 6's W_i) instead of w_i and the projection;
* full with per-degree output 1×1 convs and the projection;
* full with Eq. 6's per-token W ∈ R^{N×C×(d−1)} and L ∈ R^{N×C} (N = 197) and the projection;
* Eq. 6's per-token W with the degree-1 term (R^{N×C×d}) and L, no projection;
* full with MLP ratio 3 instead of 4 (``LinAttnViT(mlp_ratio=3)``).

"Both": the reading reproduces Table 2's parameters (as the paper truncates them: printed ≤ count <
printed + 1) and Table 6 (2 × MACs within 5 %) at every degree counted. Last, an analytic scan of
every mixer with P = p0 + p1·(d−1) point-wise and Q = q0 + q1·(d−1) depth-wise layers
(0 ≤ p0, p1, q0, q1 ≤ 10) and MLP ratio 1 to 4, against the same rows and degrees.
"""
import argparse
import itertools
import json
import re

import torch
import torch.nn as nn

from linattn_mm.flops import count_macs
from linattn_mm.models.attentions.padre import PADReMixer
from linattn_mm.models.backbones.vit import LinAttnViT

K = 11  # token kernel
WIDTH = {'T': 192, 'S': 384, 'B': 768}
PAPER_PARAMS_M = {'T-2': 5, 'T-3': 7, 'S-2': 20, 'S-3': 26, 'B-2': 80}  # Table 2
PAPER_TABLE6_GFLOPS = {2: 1.10, 3: 2.28, 4: 3.27}  # Table 6: N = 4096, C = 192
N6, C6, HW6 = 4096, 192, (64, 64)

# (reading as the doc's table lists it, PW / DW per mixer, module[, PW / DW of the MACs where a
# shared layer runs more than once]): a dict with 'layout' is the real PADReMixer in the real
# LinAttnViT (with 'mlp_ratio': that of the ViT), any other dict the keyword arguments of Reading
READINGS = [
    ('compact (default): Z_1 = X, Y_i = X B_i, C_i / D_i on every Z_i, per-degree output W_i',
     '3(d−1) / d−1', dict(layout='compact')),
    ('full (previous default): every A_i, B_i, C_i, D_i; per-channel w_i + one projection',
     '2d / 2d−1', dict(layout='full')),
    ('full without D_i (token mixing only on Z_i); same counts: one B shared by all Y_i, '
     'per-degree A_i', 'd+1 / 2d−1', dict(dropped='D')),
    ('full without C_i (channel mixing only on Z_i)', '2d / d', dict(dropped='C')),
    ('no C_i, D_i (Z_{i+1} = Z_i ⊙ Y_{i+1}); same counts: one Y = A X B for all degrees with '
     'per-degree C_i, D_i (Hyena-like)', 'd+1 / d', dict(dropped='CD')),
    ('A on Y_1 only, no C_i, D_i (Conv2Former, App. B.2, continued by products)', 'd+1 / 1',
     dict(dropped='CD', a_first=True)),
    ('full with C_i, D_i shared across degrees (MACs as full)', 'd+2 / d+1', dict(shared='CD'),
     '2d / 2d−1'),
    ('A, B, C, D all shared across degrees', '3 / 2 (MACs: d+1 / d)', dict(shared='ABCD')),
    ('full with per-degree output 1×1 convs (Eq. 6\'s W_i) instead of w_i + projection',
     '3d−2 / 2d−1', dict(out='conv', proj=False)),
    ('full with per-degree output 1×1 convs and the projection', '3d−1 / 2d−1', dict(out='conv')),
    ('full with Eq. 6\'s per-token W ∈ R^{N×C×(d−1)} and L ∈ R^{N×C} (N = 197)',
     '2d / 2d−1 + d·N·C', dict(out='token')),
    ('Eq. 6 per-token W with the degree-1 term (R^{N×C×d}) and L, no projection',
     '2d−1 / 2d−1 + (d+1)·N·C', dict(out='token', proj=False, deg1=True)),
    ('full with MLP ratio 3 instead of 4 (the ratio leaves Table 6 unchanged, in any reading)',
     '2d / 2d−1', dict(layout='full', mlp_ratio=3)),
]


class Reading(nn.Module):
    """A PADRe mixer with per-degree modules chosen by the arguments (the readings other than the
    two layouts of PADReMixer; with the defaults it is the full layout).

    Args:
        shared (str): of 'ABCD', the modules shared by all degrees (A and B shared: one Y for all).
        dropped (str): of 'CD', the modules left out.
        a_first (bool): A on Y_1 only.
        out (str): 'channel' (per-channel w_i), 'conv' (per-degree Linear W_i) or 'token' (Eq. 6's
            per-token W_i ∈ R^{N×C} and L ∈ R^{N×C}).
        proj (bool): a final Linear. deg1 (bool): Z_1 enters the output too.
        extra (int): class tokens: their (alpha, beta) pairs per token conv are held (counted), but
            the forward (Table 6) runs on grid tokens only.
    """

    def __init__(self, C, d, N=197, extra=1, shared='', dropped='', a_first=False,
                 out='channel', proj=True, deg1=False):
        super().__init__()

        def num(key, per):
            return 0 if key in dropped else 1 if key in shared else per

        lin = lambda: nn.Linear(C, C)  # noqa: E731
        dw = lambda: nn.Conv2d(C, C, K, padding=K // 2, groups=C)  # noqa: E731
        self.d, self.out_mode, self.deg1 = d, out, deg1
        self.B = nn.ModuleList(lin() for _ in range(num('B', d)))
        self.A = nn.ModuleList(dw() for _ in range(1 if a_first else num('A', d)))
        self.D = nn.ModuleList(lin() for _ in range(num('D', d - 1)))
        self.C = nn.ModuleList(dw() for _ in range(num('C', d - 1)))
        terms = d if deg1 else d - 1
        if out == 'channel':
            self.w = nn.Parameter(torch.ones(terms, C))
        elif out == 'conv':
            self.W = nn.ModuleList(lin() for _ in range(terms))
        else:
            self.w = nn.Parameter(torch.ones(terms, N, C))
            self.L = nn.Parameter(torch.zeros(N, C))
        self.proj = lin() if proj else None
        if extra:
            self.cls_pairs = nn.Parameter(torch.ones(len(self.A) + len(self.C), 2, C))
        self.per_token = (terms + 1) * N * C if out == 'token' else 0

    @staticmethod
    def _tok(conv, t, hw):
        g = t.transpose(1, 2).unflatten(2, hw)
        return conv(g).flatten(2).transpose(1, 2)

    def forward(self, x, hw):
        ys = []
        for i in range(self.d):
            if i and len(self.B) == 1:  # one Y for all degrees
                ys.append(ys[0])
                continue
            y = self.B[i](x)
            ys.append(self._tok(self.A[i], y, hw) if i < len(self.A) else y)
        zs = [ys[0]]
        for i in range(self.d - 1):
            t = self.D[min(i, len(self.D) - 1)](zs[-1]) if len(self.D) else zs[-1]
            if len(self.C):
                t = self._tok(self.C[min(i, len(self.C) - 1)], t, hw)
            zs.append(t * ys[i + 1])
        terms = zs if self.deg1 else zs[1:]
        if self.out_mode == 'conv':
            s = sum(W(z) for W, z in zip(self.W, terms))
        else:
            s = sum(w * z for w, z in zip(self.w, terms))
            if self.out_mode == 'token':
                s = s + self.L
        return self.proj(s) if self.proj is not None else s


def nparams(module):
    return sum(p.numel() for p in module.parameters())


def mixer(spec, C, d, N=197, extra=1):
    if 'layout' in spec:
        return PADReMixer(C, degree=d, layout=spec['layout'], num_extra_tokens=extra).eval()
    return Reading(C, d, N=N, extra=extra, **spec).eval()


_VITS = {}


def vit_params(arch, d, layout, mlp_ratio=4):
    """Parameters of the PADRe-DeiT classifier (LinAttnViT + 1000-way head), and of one mixer."""
    key = (arch, d, layout, mlp_ratio)
    if key not in _VITS:
        C = WIDTH[arch]
        m = LinAttnViT(arch=arch.lower(), mlp_ratio=mlp_ratio, out_type='cls_token',
                       attn_cfg=dict(type='PADReMixer', degree=d, layout=layout))
        _VITS[key] = (nparams(m) + C * 1000 + 1000, nparams(m.blocks[0].attn))
    return _VITS[key]


def classifier_params(spec, arch, d):
    if 'layout' in spec:
        return vit_params(arch, d, spec['layout'], spec.get('mlp_ratio', 4))[0]
    # the full-layout classifier with its 12 mixers replaced by the reading's
    full, full_mixer = vit_params(arch, d, 'full')
    return full + 12 * (nparams(mixer(spec, WIDTH[arch], d)) - full_mixer)


def layer_counts(module, C):
    """(point-wise C×C layers, depth-wise k×k convs over C channels, per-token parameters)."""
    pw = sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear)) / C ** 2
    dw = sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Conv2d)) / (C * K * K)
    return pw, dw, getattr(module, 'per_token', 0)


def count_formula(text, d, N, C):
    """The doc's 'PW / DW [+ per-token] [(MACs: PW / DW)]' at degree d: (pw, dw, per-token,
    MAC pw, MAC dw)."""
    m = re.fullmatch(r'(\S+) / (\S+)(?: \+ (\S+))?(?: \(MACs: (\S+) / (\S+)\))?', text)

    def ev(expr):  # '3(d−1)' -> 3*(d-1), 'd·N·C' -> d*N*C
        expr = re.sub(r'(\d|\))([dNC(])', r'\1*\2', expr.replace('−', '-').replace('·', '*'))
        return eval(expr, {'d': d, 'N': N, 'C': C})

    pw, dw, tok, mpw, mdw = m.groups()
    return ev(pw), ev(dw), ev(tok or '0'), ev(mpw or pw), ev(mdw or dw)


def count(label, counts, spec, mac_counts=None, *, rows, degrees):
    params = {}
    for row in rows:
        arch, d = row[0], int(row[2])
        params[row] = classifier_params(spec, arch, d)
        m = mixer(spec, WIDTH[arch], d)
        assert layer_counts(m, WIDTH[arch]) == count_formula(counts, d, 197, WIDTH[arch])[:3], \
            (label, row, layer_counts(m, WIDTH[arch]))
    macs = {}
    for d in degrees:
        m = mixer(spec, C6, d, N=N6, extra=0)
        macs[d] = count_macs(m, torch.randn(1, N6, C6), HW6).total
        pw, dw, tok, mpw, mdw = count_formula(counts, d, N6, C6)
        if mac_counts:
            mpw, mdw = count_formula(mac_counts, d, N6, C6)[:2]
        assert layer_counts(m, C6) == (pw, dw, tok), (label, d, layer_counts(m, C6))
        assert macs[d] == N6 * (mpw * C6 ** 2 + mdw * C6 * K * K), (label, d, macs[d])
    return dict(reading=label, pw_dw=counts, params=params, table6_macs=macs)


def fits(params_of, t6_macs_of, rows, degrees, flops_per_mac=2):
    """Per degree: (the counts reproduce Table 2 (truncated) and Table 6 (within 5 %) where they
    have that degree, both tables have it)."""
    ok, tables = {}, {}
    for row in rows:
        p, d = PAPER_PARAMS_M[row], int(row[2])
        ok[d] = ok.get(d, True) and p * 1e6 <= params_of(row) < (p + 1) * 1e6
        tables[d] = tables.get(d, 0) | 1
    for d in degrees:
        paper = PAPER_TABLE6_GFLOPS[d]
        ok[d] = ok.get(d, True) and abs(flops_per_mac * t6_macs_of(d) / 1e9 / paper - 1) <= 0.05
        tables[d] = tables.get(d, 0) | 2
    return {d: (ok[d], tables[d] == 3) for d in sorted(ok)}


def both(fit):
    if all(ok for ok, _ in fit.values()):
        return 'yes'
    only = [str(d) for d, (ok, in_both) in fit.items() if ok and in_both]
    return f"no (d = {', '.join(only)} only)" if only else 'no'


def scan(rows, degrees):
    """Mixers of P = p0 + p1(d−1) point-wise and Q = q0 + q1(d−1) depth-wise layers (with biases),
    MLP ratio r: the fits, with Table 6 read as 2 × MACs and as MACs."""
    base = {}  # classifier without its mixers, MLP ratio 4
    for row in rows:
        arch, d = row[0], int(row[2])
        full, full_mixer = vit_params(arch, d, 'full')
        base[row] = full - 12 * full_mixer

    def mlp(C, r):
        h = int(C * r)
        return 2 * C * h + h + C

    found = {2: [], 1: []}
    ratios = [1 + 0.5 * i for i in range(7)]
    for p0, p1, q0, q1 in itertools.product(range(11), repeat=4):
        P = lambda d: p0 + p1 * (d - 1)  # noqa: E731
        Q = lambda d: q0 + q1 * (d - 1)  # noqa: E731
        t6 = lambda d: N6 * (P(d) * C6 ** 2 + Q(d) * C6 * K * K)  # noqa: E731
        for r in ratios:
            def params_of(row, r=r):
                C, d = WIDTH[row[0]], int(row[2])
                return (base[row] + 12 * (P(d) * (C * C + C) + Q(d) * (K * K * C + C))
                        + 12 * (mlp(C, r) - mlp(C, 4)))
            for flops_per_mac in found:
                if all(ok for ok, _ in fits(params_of, t6, rows, degrees,
                                            flops_per_mac).values()):
                    found[flops_per_mac].append((p0, p1, q0, q1, r))
    return found


def linear_in_d(c0, c1):
    """c0 + c1·(d−1) as the doc writes it: '3(d−1)', 'd−1', '2', '1 + d−1'."""
    terms = [str(c0)] if c0 or not c1 else []
    return ' + '.join(terms + ([f'{c1}(d−1)' if c1 > 1 else 'd−1'] if c1 else []))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--rows', nargs='+', choices=list(PAPER_PARAMS_M), default=list(PAPER_PARAMS_M),
                   help='PADRe-DeiT rows of Table 2 (arch-degree)')
    p.add_argument('--degrees', nargs='+', type=int, choices=list(PAPER_TABLE6_GFLOPS),
                   default=list(PAPER_TABLE6_GFLOPS), help='degrees of Table 6')
    p.add_argument('--json', help='also write the counts to this JSON file')
    args = p.parse_args(argv)
    rows, degrees = args.rows, args.degrees
    torch.manual_seed(0)
    results = [count(*r, rows=rows, degrees=degrees) for r in READINGS]

    slash = ' / '.join
    print(f"| Reading | PW / DW | Params (M) {slash(rows)} (paper "
          f"{slash(str(PAPER_PARAMS_M[r]) for r in rows)}) | Table 6: GMACs d = "
          f"{slash(map(str, degrees))} (× 2; paper "
          f"{slash(f'{PAPER_TABLE6_GFLOPS[d]:.2f}' for d in degrees)} GFLOPs) | Both |")
    print('|---|---|---|---|---|')
    full = next(r for r in results if r['reading'].startswith('full (previous default)'))
    for r in results:
        r['both'] = both(fits(r['params'].get, r['table6_macs'].get, rows, degrees))
        t6 = r['table6_macs']
        if r is not full and t6 == full['table6_macs']:
            t6_text = 'as full'
        else:
            t6_text = (f"{slash(f'{v / 1e9:.3f}' for v in t6.values())} "
                       f"({slash(f'{2 * v / 1e9:.2f}' for v in t6.values())})")
        print(f"| {r['reading']} | {r['pw_dw']} | "
              f"{slash(f'{v / 1e6:.2f}' for v in r['params'].values())} | {t6_text} | "
              f"{r['both']} |")

    found = scan(rows, degrees)
    print(f'\nScan: P = p0 + p1·(d−1) point-wise, Q = q0 + q1·(d−1) depth-wise layers '
          f'(0 ≤ p0, p1, q0, q1 ≤ 10), MLP ratio 1 to 4 (step 0.5); fits of rows {slash(rows)} '
          f'(truncated) and Table 6 d = {slash(map(str, degrees))} (within 5 %):')
    for flops_per_mac, what in ((2, 'Table 6 as 2 × MACs'), (1, 'Table 6 as MACs')):
        fs = found[flops_per_mac]
        shown = '; '.join(f'P = {linear_in_d(p0, p1)}, Q = {linear_in_d(q0, q1)}, ratio {r:g}'
                          for p0, p1, q0, q1, r in fs[:10])
        more = f'; ... ({len(fs)} in all)' if len(fs) > 10 else ''
        print(f'  {what}: {shown + more if fs else "none"}')

    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(rows=rows, degrees=degrees, readings=results,
                           scan={str(k): v for k, v in found.items()}), f, indent=1)


if __name__ == '__main__':
    main()
