"""Test (evaluate) a checkpoint with any mmdet / mmseg / mmpretrain config.

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--out FILE] [--show-dir DIR]
                         [--cfg-options k=v ...] [--launcher none|pytorch|slurm|mpi] [--tta]
                         [--no-convert] [--partial-checkpoint] [--demo]

A checkpoint that lacks parameters of the config's model, or holds them in other shapes, is an
error (``--partial-checkpoint``: a warning, and those parameters keep their initial values).
The model's blocks and mixers run their inference forms (:func:`linattn_mm.deploy.convert`: same
outputs, faster); ``--no-convert`` keeps the plain forms. ``--demo`` runs CONFIG on the generated
demo data (``linattn_mm.demo``).

The metrics are logged by the evaluator and printed as one JSON line starting with
``linattn_mm metrics:``.
"""
import argparse
import json
import numbers

import linattn_mm  # noqa: F401
from linattn_mm.checkpoint import safe_globals
from linattn_mm.cli import (CheckpointMismatch, add_common_args, apply_launcher_defaults,
                            apply_tta, build_runner, checkpoint_file_problem, checkpoint_fit_hook,
                            close_process_group, load_config, parse_with_common)
from linattn_mm.deploy import convert


def parse_args(argv=None):
    p = argparse.ArgumentParser(description='Test a detector, segmentor or classifier')
    p.add_argument('config', help='config file path, or a model-zoo name '
                   '(linattn_mm.list_models())')
    p.add_argument('checkpoint', help='checkpoint file')
    p.add_argument('--out', help='dump predictions to this pickle file (mmdet, mmpretrain) or '
                   'prediction images to this directory (mmseg)')
    p.add_argument('--show-dir', help='save drawn predictions in DIR (mmdet configs: under '
                   'work_dir/<timestamp>/DIR, as its own test tool)')
    p.add_argument('--tta', action='store_true', help='test-time augmentation (tta_model and '
                   'tta_pipeline of the config; mmdet / mmpretrain configs without them: flip, '
                   'as their test tools)')
    p.add_argument('--no-convert', action='store_true', help='run the plain forms of the blocks '
                   'and mixers instead of their inference forms (linattn_mm.deploy.convert)')
    p.add_argument('--partial-checkpoint', action='store_true', help='evaluate a checkpoint that '
                   'lacks some of the model\'s parameters or holds them in other shapes (they '
                   'keep their initial values); without it such a checkpoint is an error')
    return parse_with_common(add_common_args(p), argv)


def set_show_dir(cfg, scope, show_dir):
    """Turn on the config's visualization hook, saving the drawn predictions of every test image
    in ``show_dir`` where each library's own test tool puts them (the hooks take different
    arguments)."""
    hook = cfg.default_hooks.get('visualization')
    if hook is None:
        raise SystemExit('error: the config has no visualization hook '
                         '(default_hooks.visualization) for --show-dir')
    if scope == 'mmpretrain':  # VisualizationHook(enable, out_dir)
        hook.update(enable=True, out_dir=show_dir, interval=1)
    elif scope == 'mmseg':  # SegVisualizationHook(draw); the images go to the visualizer's dir
        hook.update(draw=True, interval=1)
        cfg.visualizer['save_dir'] = show_dir
    else:  # mmdet's DetVisualizationHook: under work_dir/<timestamp>/show_dir
        hook['draw'] = True
        hook['test_out_dir'] = show_dir


def main(argv=None):
    args = parse_args(argv)
    problem = checkpoint_file_problem(args.checkpoint)
    if problem:
        raise SystemExit(f'error: {problem}')
    cfg = load_config(args)
    cfg.load_from = args.checkpoint
    scope = cfg.get('default_scope', 'mmdet')
    if args.show_dir:
        set_show_dir(cfg, scope, args.show_dir)
    if args.tta:
        apply_tta(cfg, scope)
    if args.out:
        if scope == 'mmseg':
            cfg.test_evaluator['output_dir'] = args.out
            cfg.test_evaluator['keep_results'] = True
        else:
            evaluators = cfg.test_evaluator if isinstance(cfg.test_evaluator, list) else [
                cfg.test_evaluator]
            cfg.test_evaluator = evaluators + [dict(type='DumpResults', out_file_path=args.out)]
    apply_launcher_defaults(cfg)
    runner = build_runner(cfg)
    # checks the checkpoint when the runner has read it, before it fills the model
    runner.register_hook(checkpoint_fit_hook(args.checkpoint, args.partial_checkpoint),
                         priority='VERY_HIGH')
    if not args.no_convert:
        # in place, before the checkpoint is loaded: the inference forms keep no copy of a weight
        # (their caches follow in-place loads), so the loaded weights are the ones that run
        convert(runner.model)
    try:
        with safe_globals():  # mmengine checkpoints hold HistoryBuffers and numpy values
            metrics = runner.test()
    except CheckpointMismatch as e:
        close_process_group(wait=False)
        raise SystemExit(f'error: {e}')
    except BaseException:
        close_process_group(wait=False)
        raise
    close_process_group()
    if runner.rank == 0:
        print('linattn_mm metrics: ' + json.dumps(
            {k: (float(v) if isinstance(v, numbers.Real) else str(v))
             for k, v in (metrics or {}).items()}, sort_keys=True), flush=True)


if __name__ == '__main__':
    main()
