"""The tools as command-line scripts (subprocesses): one training iteration and a test pass with
metrics on the demo data (``--demo``), and a new detector written by config inheritance. (Every
config of every head is run on the demo data through the same tools in
tests/e2e/test_all_demo_configs.py.)"""
import glob
import os.path as osp
import re

import pytest
from harness import CONFIGS as CFG
from harness import metrics_of, run_python, run_tool, short_run_options

DET_SHORT = ['train_cfg.max_epochs=1', 'train_cfg.val_interval=1', 'train_dataloader.batch_size=2',
             'train_dataloader.dataset.indices=2', 'val_dataloader.dataset.indices=2']
CASES = [
    # (config, train options, test options, metric keys that must be present)
    ('swin/mask-rcnn_swin-t_fpn_1x_coco.py', DET_SHORT + ['model.test_cfg.rcnn.score_thr=0.0'],
     ['test_dataloader.dataset.indices=2', 'model.test_cfg.rcnn.score_thr=0.0'],
     ['coco/bbox_mAP', 'coco/segm_mAP']),
    ('pvt/pvt-t_in1k.py',
     ['train_cfg.max_epochs=1', 'train_cfg.val_interval=1', 'train_dataloader.batch_size=4',
      'train_dataloader.dataset.indices=4', 'val_dataloader.dataset.indices=8'],
     ['test_dataloader.dataset.indices=8'], ['accuracy/top1', 'accuracy/top5']),
]


@pytest.mark.parametrize('config,train_opts,test_opts,keys', CASES,
                         ids=[osp.basename(c[0])[:-3] for c in CASES])
def test_train_one_iteration_and_test(demo_data, tmp_path, config, train_opts, test_opts, keys):
    cfg = osp.join(CFG, config)
    work = str(tmp_path / 'work')
    out = run_tool(['tools/train.py', cfg, '--demo', '--work-dir', work, '--cfg-options'] +
                   train_opts)
    assert 'Saving checkpoint' in out
    with open(osp.join(work, 'last_checkpoint')) as f:
        ckpt = f.read().strip()
    assert osp.isfile(ckpt)
    out = run_tool(['tools/test.py', cfg, ckpt, '--demo', '--work-dir', work, '--cfg-options'] +
                   test_opts)
    metrics = metrics_of(out)
    for k in keys:
        assert k in metrics, (k, metrics)
        assert 0.0 <= metrics[k] <= 100.0


NEW_DETECTOR = '''
# A detector that linattn_mm ships no config for, written by inheritance from stock files.
_base_ = ['mmdet::atss/atss_r50_fpn_1x_coco.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(_delete_=True, type='LinAttnSwin', arch='t', out_indices=(1, 2, 3)),
    neck=dict(in_channels=[192, 384, 768], start_level=0, add_extra_convs='on_output',
              num_outs=5))
optim_wrapper = dict(_delete_=True, type='OptimWrapper',
                     optimizer=dict(type='AdamW', lr=1e-4, weight_decay=0.05))
'''


def test_new_detector_config_by_inheritance(demo_data, tmp_path):
    """ATSS with a linattn_mm backbone, by inheritance from the stock config, put on the demo data
    by ``--demo`` (the overlay takes any COCO detector)."""
    cfg = tmp_path / 'atss_linattn-swin-t_fpn_1x_coco.py'
    cfg.write_text(NEW_DETECTOR)
    work = str(tmp_path / 'work')
    out = run_tool(['tools/train.py', str(cfg), '--demo', '--work-dir', work, '--cfg-options'] +
                   DET_SHORT + ['model.test_cfg.score_thr=0.0'])
    assert 'loss_centerness' in out and 'Saving checkpoint' in out


def _train_briefly(config, work):
    """One training iteration of ``config`` on the demo data; returns (config path, checkpoint,
    test options)."""
    from mmengine.config import Config
    cfg_path = osp.join(CFG, config)
    train, test, _ = short_run_options(Config.fromfile(cfg_path))
    run_tool(['tools/train.py', cfg_path, '--demo', '--work-dir', work, '--cfg-options'] + train)
    with open(osp.join(work, 'last_checkpoint')) as f:
        return cfg_path, f.read().strip(), test


@pytest.mark.parametrize('config,pattern', [
    ('polaformer/fpn_pola-pvt-t_8xb4-40k_ade20k-512x512.py', 'vis_data/vis_image/*.png'),
    ('pvt/pvt-t_in1k.py', '*.png')], ids=['mmseg', 'mmpretrain'])
def test_show_dir_draws_every_test_image(demo_data, tmp_path, config, pattern):
    """``--show-dir`` turns on the visualization hook of mmseg and mmpretrain configs too (each
    takes other arguments than mmdet's): one drawn image per test image, in DIR."""
    cfg, ckpt, test = _train_briefly(config, str(tmp_path / 'work'))
    vis = tmp_path / 'vis'
    run_tool(['tools/test.py', cfg, ckpt, '--demo', '--work-dir', str(tmp_path / 'work'),
              '--show-dir', str(vis), '--cfg-options'] + test)
    assert len(glob.glob(str(vis / pattern))) == 2  # the test set of the short run: 2 images


@pytest.mark.parametrize('config,metric', [
    ('polaformer/retinanet_pola-pvt-t_fpn_1x_coco.py', 'coco/bbox_mAP'),
    ('pvt/pvt-t_in1k.py', 'accuracy/top1')], ids=['mmdet', 'mmpretrain'])
def test_tta_without_tta_settings_in_the_config_flips(demo_data, tmp_path, config, metric):
    """``--tta`` on a config without ``tta_model`` / ``tta_pipeline``: flip test-time
    augmentation, the default of mmdet's and mmpretrain's own test tools, with a warning. (mmdet's
    DetTTAModel merges boxes only: a model with masks is a clear error.)"""
    cfg, ckpt, test = _train_briefly(config, str(tmp_path / 'work'))
    out = run_tool(['tools/test.py', cfg, ckpt, '--demo', '--tta', '--work-dir',
                    str(tmp_path / 'work'), '--cfg-options'] + test)
    assert '--tta: the config has no tta_model or tta_pipeline' in out
    assert metric in metrics_of(out)


def test_apply_tta_builds_each_librarys_default():
    """The wrapped model and the flip pipeline of ``--tta`` per library; an mmseg config without
    them is an error (mmseg's tool has no default)."""
    import argparse
    import copy

    from mmengine.config import Config

    from linattn_mm.cli import add_common_args, apply_tta, load_config, parse_with_common
    parser = argparse.ArgumentParser()
    parser.add_argument('config')
    parser = add_common_args(parser)
    for config, wrapper, pack in (
            ('polaformer/retinanet_pola-pvt-t_fpn_1x_coco.py', 'DetTTAModel', 'PackDetInputs'),
            ('pvt/pvt-t_in1k.py', 'mmpretrain.AverageClsScoreTTA', 'PackInputs')):
        cfg = load_config(parse_with_common(parser, [osp.join(CFG, config)]))
        stock = Config.fromfile(osp.join(CFG, config))
        with pytest.warns(UserWarning, match='flip test-time augmentation'):
            apply_tta(cfg, cfg.default_scope)
        assert cfg.model.type == wrapper and cfg.model.module == stock.model
        pipe = cfg.test_dataloader.dataset.pipeline
        assert pipe[:-1] == stock.test_dataloader.dataset.pipeline[:-1]
        assert pipe[-1].type == 'TestTimeAug'
        assert [t.prob for t in pipe[-1].transforms[0]] == [1., 0.]
        assert [t.type for t in pipe[-1].transforms[1]] == [pack]
    masks = load_config(parse_with_common(parser, [
        osp.join(CFG, 'polaformer/mask-rcnn_pola-pvt-t_fpn_1x_coco.py')]))
    with pytest.raises(SystemExit, match="error: --tta: mmdet's DetTTAModel merges boxes only"), \
            pytest.warns(UserWarning):
        apply_tta(masks, 'mmdet')
    seg = load_config(parse_with_common(parser, [
        osp.join(CFG, 'nalaformer/upernet_nalaformer-t_8xb2-160k_ade20k-512x512.py')]))
    assert seg.tta_model.type == 'SegTTAModel'  # from the stock bases: used as they are
    tta_pipeline = copy.deepcopy(seg.tta_pipeline)
    apply_tta(seg, 'mmseg')
    assert seg.model.type == 'SegTTAModel' and seg.model.module.type == 'EncoderDecoder'
    assert seg.test_dataloader.dataset.pipeline == tta_pipeline
    seg = load_config(parse_with_common(parser, [  # the stock Semantic FPN bases have none
        osp.join(CFG, 'polaformer/fpn_pola-pvt-t_8xb4-40k_ade20k-512x512.py')]))
    with pytest.raises(SystemExit, match='error: --tta needs tta_pipeline in the config'):
        apply_tta(seg, 'mmseg')


def test_test_refuses_a_checkpoint_that_does_not_fit_the_config(demo_data, tmp_path):
    """tools/test.py evaluates only a checkpoint that holds every parameter of the config's model
    in its shape (mmengine's runner would evaluate the rest at their initial values): another
    arch is an error that names the parameters; --partial-checkpoint evaluates anyway with a
    warning; a checkpoint file that does not exist or is cut short is a one-line error before
    anything is built."""
    cfg, ckpt, test = _train_briefly('pvt/pvt-t_in1k.py', str(tmp_path / 'work'))
    cmd = ['tools/test.py', cfg, ckpt, '--demo', '--work-dir',
           str(tmp_path / 'work'), '--cfg-options', 'model.backbone.arch=s'] + test
    res = run_python(cmd)
    assert res.returncode == 1 and 'Traceback' not in res.stderr, res.stderr[-3000:]
    assert re.search(r"error: checkpoint '.*' does not fit the model of the config: \d+ of its "
                     r"\d+ parameters are missing \(e\.g\. 'backbone\.block1\.2\.", res.stderr)
    res = run_python(cmd + ['--partial-checkpoint'])
    assert res.returncode == 0, res.stderr[-3000:]
    assert 'evaluating anyway (--partial-checkpoint)' in res.stdout + res.stderr
    assert 'accuracy/top1' in metrics_of(res.stdout + res.stderr)
    res = run_python(['tools/test.py', cfg, str(tmp_path / 'no.pth')])
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == f"error: no checkpoint file '{tmp_path}/no.pth'"
    (tmp_path / 'cut.pth').write_bytes(open(ckpt, 'rb').read()[:4096])  # a download cut short
    res = run_python(['tools/test.py', cfg, str(tmp_path / 'cut.pth')])
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: '{tmp_path}/cut.pth' (4096 bytes) is truncated or not a torch checkpoint "
        f"(incomplete download? re-download it)")
