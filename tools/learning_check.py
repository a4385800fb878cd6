"""Learning check: every attention family's demo Mask R-CNN and UperNet trained on the demo data
for a fixed budget, next to the softmax skeleton trained with the same budget.

    python tools/learning_check.py [--task det seg] [--only FAMILY ...] [--skeleton nat|own]
        [--iters N] [--workers 2] [--work-dir work_dirs/learning_check] [--out docs/fidelity.md]
        [--json FILE] [--plot FILE]

Each run trains a tiny Mask R-CNN / UperNet with one shared recipe (below: a tiny backbone, narrow
heads, AdamW, warm-up then cosine decay, ``--iters`` iterations, seed 0, random initialisation),
followed by the evaluation on the demo validation split. By default (``--skeleton nat``) every
family's token mixer goes into the same NAT-style skeleton (SeTformer's conv-stem hierarchy) next to
global softmax attention in it; ``--skeleton own`` trains each family's own config instead. Every
run goes through the demo overlay (``linattn_mm.demo``: the demo data, no pretrained file, the CPU
settings), which leaves the recipe's keys (``demo_keep``) alone.
The recipe is the same for every run, so the table compares the token mixers, not the schedules.
The untrained row is the softmax model evaluated before its first step. Writes the results between the ``learning-check``
markers of ``--out`` (``docs/fidelity.md``), a loss-curve PNG and a JSON file. This is a
benchmark (minutes per run on a CPU); the tests run it with a few iterations.
"""
import argparse
import copy
import json
import os
import os.path as osp
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))

# ``--skeleton own``: each family in the skeleton of its own config. family -> (config
# folder, model name in the config file names, the softmax run it is compared with). The skeletons
# are those with a normalised output per stage (Swin, and the native NaLaFormer / SeTformer
# hierarchies): PVT v1 returns its stage maps without a norm (as the official detection code), and
# trained from scratch with the norm-free FPN on top its last-stage activations grow without bound
# within ~100 steps (with ImageNet weights, as the PVT configs are meant to be used, they do not).
# The patchify stems of Swin and NaLaFormer learn far more slowly from scratch than the conv stem,
# which is why ``nat`` is the default.
FAMILIES = {
    'softmax': ('swin', 'swin-t', None),
    'polaformer': ('polaformer', 'pola-swin-t', 'softmax'),
    'nalaformer': ('nalaformer', 'nalaformer-t', 'nalaformer-softmax'),
    'padre': ('padre', 'padre-swin-t', 'softmax'),
    'poly': ('poly', 'poly-swin-t', 'softmax'),
    'setformer': ('setformer', 'setformer-t', 'setformer-softmax'),
}
#: the config of each task (run through the demo overlay), by config folder and model name
TASK_CONFIG = dict(det='configs/{}/mask-rcnn_{}_fpn_1x_coco.py',
                   seg='configs/{}/upernet_{}_8xb2-160k_ade20k-512x512.py')
#: the recipe's keys, which the demo overlay leaves as the recipe sets them
RECIPE_KEYS = ['optim_wrapper', 'param_scheduler', 'train_cfg', 'default_hooks']


def task_config(task, family):
    """The ``task`` config of ``family``'s own skeleton."""
    folder, model, _ = FAMILIES[family]
    return TASK_CONFIG[task].format(folder, model)


# The default check (``--skeleton nat``) puts every family's token mixer into one skeleton: the
# NAT-style hierarchy of SeTformer (conv stem, conv downsamplers, a LayerNorm on every output), next
# to the same skeleton with global softmax attention. Any mixer fits any skeleton, so the table
# compares the mixers alone. Mixer settings are those of the family's Swin / native configs.
NAT = {task: task_config(task, 'setformer') for task in TASK_CONFIG}
SKELETONS = ('nat', 'own')
MIXERS = {
    'softmax': dict(type='GlobalSoftmaxAttention'),
    'polaformer': dict(type='PolaLinearAttention', qkv_layout='qkvg', alpha=4, kernel_size=5),
    'nalaformer': dict(type='NormAwareLinearAttention'),
    'padre': dict(type='PADReMixer', degree=2, kernel_size=11),
    'poly': dict(type='PolySelfAttention'),
    # the COCO / ADE20K settings of the SeTformer configs with the demo's 64 references
    'setformer': dict(type='SeTAttention', num_refs=64, eps=0.3, tau=0.8),
}
# softmax skeletons that are a linear family's own config with the attention swapped: name ->
# (family whose config is used, backbone overrides)
SOFTMAX_VARIANTS = {
    'nalaformer-softmax': ('nalaformer', dict(attn_cfg=dict(type='NaLaSoftmaxAttention'))),
    'setformer-softmax': ('setformer', dict(attn_cfg=dict(_delete_=True,
                                                          type='GlobalSoftmaxAttention'))),
}

# The shared recipe. Detection: narrow FPN / RPN / RoI heads (64 channels, 2 mask convs; the
# stock widths spend 85% of a CPU step in the heads); segmentation: narrow UperNet / FCN heads.
# Both: AdamW, a short linear warm-up, cosine decay to zero over the budget. No gradient clipping:
# zero-padded pixels give the first patch embedding's LayerNorm an all-zero input, whose bias
# gradient is huge (1/sqrt(eps) per padded position); a global-norm clip would then scale every
# other gradient to almost nothing. AdamW's per-parameter step is not affected.
DET_MODEL = dict(
    neck=dict(out_channels=64),
    rpn_head=dict(in_channels=64, feat_channels=64),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=64),
        bbox_head=dict(in_channels=64, fc_out_channels=256),
        mask_roi_extractor=dict(out_channels=64),
        mask_head=dict(in_channels=64, conv_out_channels=64, num_convs=2)))
SEG_MODEL = dict(decode_head=dict(channels=64), auxiliary_head=dict(channels=32))
# The tiny backbones: each skeleton with one block per stage (two in stage 3) and stage widths
# 32/64/128/256 (1.3-1.8M parameters), the attention of the family unchanged.
TINY_ARCH = {
    'swin': dict(embed_dims=32, depths=[1, 1, 2, 1], num_heads=[1, 2, 4, 8]),
    'nalaformer': dict(embed_dims=[32, 64, 128, 256], depths=[1, 1, 2, 1], num_heads=[1, 2, 4, 8],
                       mlp_ratios=[4, 4, 4, 4], layer_scale_init_values=[1, 1, 1, 1],
                       drop_path_rate=0.1),
    'setformer': dict(embed_dims=32, depths=[1, 1, 2, 1], num_heads=[1, 2, 4, 8], mlp_ratio=3.,
                      drop_path_rate=0.2, layer_scale_init_value=None),
}
TINY_CHANNELS = [32, 64, 128, 256]


def skeleton_of(config):
    """Which tiny arch a config's backbone takes."""
    name = osp.basename(config)
    return next((k for k in ('nalaformer', 'setformer') if k in name), 'swin')
DEFAULT_LR = dict(det=1e-3, seg=1e-3)


def recipe_text(config, task, iters, lr, backbone=None):
    """Text of a config that inherits ``config`` and applies the shared recipe (``backbone``:
    overrides merged into ``model.backbone``); its ``demo_keep`` keeps the recipe's schedule when
    the run applies the demo overlay."""
    warm = max(1, min(50, iters // 10))
    model = copy.deepcopy(DET_MODEL if task == 'det' else SEG_MODEL)
    model['backbone'] = dict(arch=dict(_delete_=True, **TINY_ARCH[skeleton_of(config)]),
                             **(backbone or {}))
    if task == 'det':
        model['neck']['in_channels'] = TINY_CHANNELS
    else:
        model['decode_head']['in_channels'] = TINY_CHANNELS
        model['auxiliary_head']['in_channels'] = TINY_CHANNELS[2]
    lines = [
        f'_base_ = [{osp.join(REPO, config)!r}]',
        'randomness = dict(seed=0)',
        f"optim_wrapper = dict(optimizer=dict(type='AdamW', lr={lr}, weight_decay=0.05))",
        f"param_scheduler = [dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, "
        f"end={warm}), dict(type='CosineAnnealingLR', by_epoch=False, begin={warm}, "
        f'end={max(iters, warm + 1)}, T_max={max(iters - warm, 1)}, eta_min=0.0)]',
        f"train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters={iters}, "
        f'val_interval={iters})',
        "train_dataloader = dict(sampler=dict(type='InfiniteSampler', shuffle=True))",
        'log_processor = dict(by_epoch=False)',
        f'default_hooks = dict(logger=dict(interval={min(5, iters)}), checkpoint=dict(by_epoch=False, '
        f'interval={iters}, max_keep_ckpts=1))',
        f'model = dict({_kw(model)})',
        f'demo_keep = {RECIPE_KEYS!r}',
    ]
    return '\n'.join(lines) + '\n'


def _kw(d):
    return ', '.join(f'{k}=dict({_kw(v)})' if isinstance(v, dict) else f'{k}={v!r}'
                     for k, v in d.items())


def runs_of(task, families, skeleton='nat'):
    """Run specs ``(name, config, backbone overrides)`` for ``families`` and their softmax
    counterparts (each counterpart once), softmax runs first. ``skeleton='nat'``: every family's
    mixer in the NAT skeleton next to its global-softmax form; ``'own'``: each family's own
    config next to the softmax form of that skeleton."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise SystemExit(f'unknown families {unknown}; choose from {sorted(FAMILIES)}')
    if skeleton not in SKELETONS:
        raise SystemExit(f'unknown skeleton {skeleton!r}; choose from {SKELETONS}')
    if skeleton == 'nat':
        names = ['softmax'] + [f for f in families if f != 'softmax']
        return [(name, NAT[task], dict(attn_cfg=dict(_delete_=True, **MIXERS[name])))
                for name in names]
    specs, seen = [], set()
    for fam in families:
        ref = FAMILIES[fam][2]
        for name in ([ref] if ref else []) + [fam]:
            if name in seen:
                continue
            seen.add(name)
            if name in SOFTMAX_VARIANTS:
                base, bb = SOFTMAX_VARIANTS[name]
                specs.append((name, task_config(task, base), bb))
            else:
                specs.append((name, task_config(task, name), None))
    specs.sort(key=lambda s: 'softmax' not in s[0])
    return specs


# --- one run (a subprocess: one thread, its own process) ---------------------------------------
def run_one(config_file, work_dir, untrained):
    """Train (or, ``untrained``, only evaluate the initialised model) and return the metrics and
    the logged losses."""
    from mmengine.config import Config
    from mmengine.runner import Runner

    import linattn_mm  # noqa: F401
    from linattn_mm.demo import apply_demo
    from linattn_mm.registry import register_downstream
    register_downstream()
    cfg = apply_demo(Config.fromfile(config_file))
    cfg.work_dir = work_dir
    cfg.launcher = 'none'
    runner = Runner.from_cfg(cfg)
    start = time.time()
    task = 'det' if cfg.get('default_scope') == 'mmdet' else 'seg'
    note = ''
    if untrained:
        runner._init_model_weights()
        metrics = dict(runner.val() or {})
    else:
        runner.train()
        metrics = _last_val_metrics(runner.log_dir)
    if not any(k in metrics for k in METRIC[task]):
        # mmdet's COCO metric returns nothing when no box passes the score threshold
        metrics = {k: 0.0 for k in METRIC[task]}
        note = 'no detections'
    return dict(metrics={k: float(v) for k, v in metrics.items() if _is_number(v)},
                losses=_losses(runner.log_dir), seconds=time.time() - start, note=note)


def _is_number(v):
    """True for Python, numpy and 0-d torch numbers (the metric classes return all three)."""
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return not isinstance(v, (str, bytes))


def _scalars(log_dir):
    path = osp.join(log_dir, 'vis_data', 'scalars.json')
    if not osp.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _losses(log_dir):
    return [[r['step'], r['loss']] for r in _scalars(log_dir) if 'loss' in r]


def _last_val_metrics(log_dir):
    rows = [r for r in _scalars(log_dir) if any(k in r for k in ('coco/bbox_mAP', 'mIoU'))]
    return {k: v for k, v in rows[-1].items() if k not in ('step', 'time', 'data_time')} \
        if rows else {}


def _spawn(spec, task, args, untrained=False):
    name, config, backbone = spec
    tag = f'{args.skeleton}_{task}_{name}' + ('_untrained' if untrained else '')
    work = osp.join(args.work_dir, tag)
    os.makedirs(work, exist_ok=True)
    cfg_path = osp.join(work, 'config.py')  # mmengine later overwrites it with its full dump
    stamp = osp.join(work, 'recipe.txt')
    text = recipe_text(config, task, args.iters, args.lr or DEFAULT_LR[task], backbone)
    out = osp.join(work, 'result.json')
    if args.reuse and osp.exists(out) and osp.exists(stamp) and open(stamp).read() == text:
        with open(out) as f:
            res = json.load(f)
        res.update(name=name, config=config, task=task, untrained=untrained, backbone=backbone)
        print(f'  {tag}: {_headline(task, res["metrics"])} (reused)', flush=True)
        return res
    for path in (cfg_path, stamp):
        with open(path, 'w') as f:
            f.write(text)
    if osp.exists(out):
        os.remove(out)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED='1')
    cmd = [sys.executable, osp.abspath(__file__), '--run-one', cfg_path, '--result', out]
    if untrained:
        cmd.append('--untrained')
    with open(osp.join(work, 'run.log'), 'w') as log:
        rc = subprocess.call(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f'{tag} failed (exit {rc}); see {osp.join(work, "run.log")}')
    with open(out) as f:
        res = json.load(f)
    res.update(name=name, config=config, task=task, untrained=untrained, backbone=backbone)
    print(f'  {tag}: {_headline(task, res["metrics"])} in {res["seconds"]:.0f} s', flush=True)
    return res


METRIC = dict(det=('coco/bbox_mAP', 'coco/segm_mAP'), seg=('mIoU', 'aAcc'))
# columns of the report: the headline metrics and the more sensitive ones next to them
COLUMNS = dict(det=('coco/bbox_mAP', 'coco/bbox_mAP_50', 'coco/segm_mAP', 'coco/segm_mAP_50'),
               seg=('mIoU', 'mAcc', 'aAcc'))


def _headline(task, metrics):
    return ', '.join(f'{k} {metrics.get(k, float("nan")):.3f}' for k in METRIC[task])


# --- report ----------------------------------------------------------------------------------
BEGIN, END = '<!-- learning-check:begin -->', '<!-- learning-check:end -->'


def render(results, args, command):
    if args.skeleton == 'nat':
        setting = ('every family\'s token mixer in one skeleton, the NAT-style hierarchy of '
                   'SeTformer (conv stem, conv downsamplers, a LayerNorm on every output) with one '
                   'block per stage (two in stage 3) and widths 32/64/128/256, the mixer in every '
                   'block; "softmax" is the same skeleton with global softmax attention. (With '
                   'the patchify stems of the Swin and NaLaFormer skeletons, `--skeleton own`, '
                   'neither softmax nor linear attention gets clearly above the untrained model '
                   'within this budget: the stem, not the mixer, limits learning from scratch '
                   'there)')
    else:
        setting = ('each family\'s own config (its skeleton and attention) with one block per '
                   'stage (two in stage 3) and widths 32/64/128/256; each linear family sits next '
                   'to the softmax skeleton it replaces the attention of')
    lines = [BEGIN, '## Learning check on the demo data', '',
             f'Generated by `{command}` (do not edit by hand).', '',
             f'Every run: the config through the demo overlay (`linattn_mm.demo`) with the shared '
             f'recipe of `tools/learning_check.py` '
             f'({args.iters} iterations, batch 4, AdamW lr {args.lr or DEFAULT_LR["det"]:g} with '
             f'warm-up and cosine decay; narrow heads; seed 0, random initialisation) and '
             f'{setting}; then the demo validation split. "untrained" is the softmax model '
             f'evaluated before its first step. Loss curves: '
             f'`{osp.relpath(args.plot, osp.dirname(args.out))}`.',
             '']
    for task in ('det', 'seg'):
        rows = [r for r in results if r['task'] == task]
        if not rows:
            continue
        cols = COLUMNS[task]
        title = 'Mask R-CNN (COCO-format demo data)' if task == 'det' else \
            'UperNet (ADE20K-format demo data)'
        lines += [f'### {title}', '',
                  '| Run | Config (backbone mixer) | ' + ' | '.join(cols) + ' | final loss | time (s) |',
                  '|---|---|' + '---|' * len(cols) + '---|---|']
        for r in rows:
            loss = f"{r['losses'][-1][1]:.3f}" if r['losses'] else '—'
            name = r['name'] + (' (untrained)' if r['untrained'] else '') + (
                f" ({r['note']})" if r.get('note') else '')
            vals = ' | '.join(f"{r['metrics'].get(c, 0.0 if r.get('note') else float('nan')):.3f}"
                              for c in cols)
            lines.append(f"| {name} | {_mixer_cell(r)} | {vals} | {loss} | {r['seconds']:.0f} |")
        lines.append('')
    lines.append(END)
    return '\n'.join(lines)


def _mixer_cell(r):
    """The config, and the mixer the run put into its backbone if it swapped one in."""
    attn = (r.get('backbone') or {}).get('attn_cfg')
    mixer = f" ({attn['type']})" if attn else ''
    return f"`{r['config']}`{mixer}"


def write_section(path, section):
    text = open(path).read() if osp.exists(path) else ''
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip('\n') + ('\n\n' if text else '') + section + '\n'
    with open(path, 'w') as f:
        f.write(text)


def plot(results, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    tasks = [t for t in ('det', 'seg') if any(r['task'] == t for r in results)]
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for r in results:
            if r['task'] != task or r['untrained'] or not r['losses']:
                continue
            steps, loss = zip(*r['losses'])
            ax.plot(steps, loss, ls='--' if 'softmax' in r['name'] else '-', label=r['name'])
        ax.set_title('Mask R-CNN' if task == 'det' else 'UperNet')
        ax.set_xlabel('iteration')
        ax.set_ylabel('training loss')
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--task', nargs='+', choices=['det', 'seg'], default=['det', 'seg'])
    p.add_argument('--only', nargs='+', help='families (default: all)')
    p.add_argument('--skeleton', choices=SKELETONS, default='nat',
                   help="'nat': every mixer in the NAT-style skeleton (conv stem) next to global "
                   "softmax in it (default); 'own': each family's own config")
    p.add_argument('--iters', type=int, default=300, help='training iterations per run')
    p.add_argument('--lr', type=float, help='AdamW learning rate (default: per task)')
    p.add_argument('--workers', type=int, default=2, help='runs in parallel')
    p.add_argument('--threads', type=int, default=1, help='torch threads per run')
    p.add_argument('--work-dir', default=osp.join(REPO, 'work_dirs', 'learning_check'))
    p.add_argument('--out', default=osp.join(REPO, 'docs', 'fidelity.md'))
    p.add_argument('--plot', default=osp.join(REPO, 'docs', 'learning_check.png'))
    p.add_argument('--json', help='also write every result (metrics, loss curves) here')
    p.add_argument('--reuse', action='store_true',
                   help='take the result of a run whose work dir holds one for the same recipe '
                   '(continue an interrupted check)')
    p.add_argument('--run-one', help=argparse.SUPPRESS)
    p.add_argument('--result', help=argparse.SUPPRESS)
    p.add_argument('--untrained', action='store_true', help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.run_one:
        res = run_one(args.run_one, osp.dirname(args.result), args.untrained)
        with open(args.result, 'w') as f:
            json.dump(res, f)
        return res
    from linattn_mm.demo import make_demo_data
    make_demo_data(root=osp.join(REPO, 'data', 'demo'), tasks=[
        {'det': 'coco', 'seg': 'ade'}[t] for t in args.task])
    jobs = []
    for task in args.task:
        families = args.only or [f for f in FAMILIES if f != 'softmax']
        specs = runs_of(task, families, args.skeleton)
        jobs.append((specs[0], task, True))  # the untrained softmax model
        jobs += [(spec, task, False) for spec in specs]
    print(f'{len(jobs)} runs, {args.workers} at a time, {args.iters} iterations each', flush=True)
    with ThreadPoolExecutor(args.workers) as pool:
        results = list(pool.map(lambda j: _spawn(j[0], j[1], args, j[2]), jobs))
    command = 'python tools/learning_check.py' + ''.join(
        f' {a}' for a in (argv if argv is not None else sys.argv[1:]) if a != '--reuse')
    os.makedirs(osp.dirname(osp.abspath(args.plot)), exist_ok=True)
    plot(results, args.plot)
    write_section(args.out, render(results, args, command))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=1)
    print(f'wrote {args.out} and {args.plot}')
    return results


if __name__ == '__main__':
    main()
