"""The demo overlay (linattn_mm.demo.apply_demo): its values for each kind of config, the same
result through every route (in process, ``--demo`` of the tools, the one-file config that
``python -m linattn_mm.demo`` writes for mim), and clear errors for configs it cannot take."""
import argparse
import copy
import os.path as osp

import pytest
from harness import CONFIGS, demo_form
from mmengine.config import Config

from linattn_mm.demo import apply_demo, demo_config_text

COCO_TRAIN = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=(160, 160), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]


def _cfg(rel):
    return osp.join(CONFIGS, rel)


def test_two_stage_detector():
    cfg = demo_form(_cfg('swin/mask-rcnn_swin-t_fpn_1x_coco.py'))
    loader = cfg.train_dataloader
    assert (loader.batch_size, loader.num_workers, loader.persistent_workers) == (4, 0, False)
    assert loader.dataset.data_root == 'data/demo/coco/' and loader.dataset.pipeline == COCO_TRAIN
    assert loader.dataset.ann_file == 'annotations/instances_train2017.json'  # the stock layout
    for split in ('val', 'test'):
        assert cfg[f'{split}_dataloader'].batch_size == 1
        assert cfg[f'{split}_dataloader'].dataset.pipeline[1] == dict(
            type='Resize', scale=(160, 160), keep_ratio=True)
        assert cfg[f'{split}_evaluator'].ann_file == \
            'data/demo/coco/annotations/instances_val2017.json'
    assert cfg.train_cfg.max_epochs == 12 and cfg.train_cfg.val_interval == 12
    assert [s.type for s in cfg.param_scheduler] == ['LinearLR', 'MultiStepLR']
    assert cfg.param_scheduler[1].milestones == [9, 11]
    assert cfg.optim_wrapper.optimizer.type == 'AdamW' and cfg.optim_wrapper.optimizer.lr == 2e-4
    assert cfg.default_hooks.logger.interval == 10
    assert cfg.default_hooks.checkpoint.interval == 12
    assert cfg.default_hooks.checkpoint.max_keep_ckpts == 2
    assert cfg.model.backbone.init_cfg is None
    train = cfg.model.train_cfg
    assert (train.rpn_proposal.nms_pre, train.rpn_proposal.max_per_img) == (600, 300)
    assert train.rcnn.sampler.num == 128
    # the rest of the model and the stock test settings are the config's
    stock = Config.fromfile(_cfg('swin/mask-rcnn_swin-t_fpn_1x_coco.py'))
    assert cfg.model.test_cfg == stock.model.test_cfg and cfg.model.neck == stock.model.neck
    assert train.rcnn.sampler.pos_fraction == stock.model.train_cfg.rcnn.sampler.pos_fraction


@pytest.mark.parametrize('rel', ['swin/mask-rcnn_swin-t_fpn_1x_coco.py',
                                 'setformer/fpn_setformer-t_8xb4-40k_ade20k-512x512.py',
                                 'swin/swin-t_in1k.py'])
def test_top_level_pipelines_are_the_dataloaders(rel):
    """The config's top-level ``train_pipeline`` / ``test_pipeline`` (what mmseg's
    ``inference_model`` reads) are the demo's, as the dataloaders' are."""
    cfg = demo_form(_cfg(rel))
    train = cfg.train_dataloader.dataset
    train = train.get('dataset', train)  # inside a RepeatDataset
    assert cfg.train_pipeline == train.pipeline
    assert cfg.test_pipeline == cfg.test_dataloader.dataset.pipeline
    assert cfg.test_pipeline != Config.fromfile(_cfg(rel)).test_pipeline


def test_cascade_and_one_stage_detectors_keep_their_train_cfg():
    for rel in ('swin/cascade-mask-rcnn_swin-t_fpn_4conv1fc-giou_ms-crop-3x_coco.py',
                'swin/retinanet_swin-t_fpn_1x_coco.py'):
        stock = Config.fromfile(_cfg(rel))
        cfg = demo_form(_cfg(rel))
        assert cfg.model.train_cfg == stock.model.train_cfg, rel
        assert cfg.model.backbone.init_cfg is None


def test_sgd_recipe_and_repeated_training_set():
    """The stock 3x recipe wraps the training set in a RepeatDataset (times=3): the demo repeats it
    once; the SGD recipes keep a larger step than the adaptive optimizers."""
    cfg = demo_form(_cfg('poly/cascade-mask-rcnn_r50-polynl_fpn_ms-3x_coco.py'))
    ds = cfg.train_dataloader.dataset
    assert ds.type == 'RepeatDataset' and ds.times == 1
    assert ds.dataset.data_root == 'data/demo/coco/' and ds.dataset.pipeline == COCO_TRAIN
    assert cfg.optim_wrapper.optimizer.type == 'SGD' and cfg.optim_wrapper.optimizer.lr == 0.01
    cls = demo_form(_cfg('poly/resnet50-polynl_8xb32_in1k.py'))
    assert cls.optim_wrapper.optimizer.type == 'SGD' and cls.optim_wrapper.optimizer.lr == 0.05


def test_segmentor():
    cfg = demo_form(_cfg('setformer/fpn_setformer-t_8xb4-40k_ade20k-512x512.py'))
    ds = cfg.train_dataloader.dataset
    assert ds.type == 'RepeatDataset' and ds.times == 1
    assert ds.dataset.data_root == 'data/demo/ade/ADEChallengeData2016'
    assert ds.dataset.pipeline[3] == dict(type='RandomCrop', crop_size=(128, 128),
                                          cat_max_ratio=0.75)
    assert cfg.train_dataloader.batch_size == 4 and cfg.val_dataloader.batch_size == 1
    assert cfg.train_cfg.max_iters == 400 and cfg.train_cfg.val_interval == 400
    assert [s.type for s in cfg.param_scheduler] == ['LinearLR', 'PolyLR']
    assert cfg.param_scheduler[1].end == 400
    assert tuple(cfg.model.data_preprocessor.size) == (128, 128)
    assert cfg.model.backbone.attn_cfg.num_refs == 64  # SeT on CPU: 64 references, not 800
    assert cfg.model.backbone.attn_cfg.eps == Config.fromfile(
        _cfg('setformer/fpn_setformer-t_8xb4-40k_ade20k-512x512.py')).model.backbone.attn_cfg.eps


def test_classifier():
    cfg = demo_form(_cfg('setformer/setformer-m_in1k.py'))
    assert cfg.train_dataloader.dataset.data_root == 'data/demo/imagenet'
    assert cfg.train_dataloader.batch_size == 8 and cfg.val_dataloader.batch_size == 8
    assert cfg.train_dataloader.dataset.pipeline[1] == dict(type='RandomResizedCrop', scale=64)
    assert cfg.train_cfg.max_epochs == 10 and cfg.optim_wrapper.optimizer.lr == 5e-4
    assert cfg.param_scheduler[1].type == 'CosineAnnealingLR'
    # the classification configs keep their SeT references (64x64 images)
    assert cfg.model.backbone.attn_cfg.num_refs == 500


def test_demo_keep_leaves_the_configs_own_schedule():
    path = _cfg('polaformer/mask-rcnn_pola-nat-tiny_fpn_300it_coco.py')
    stock, cfg = Config.fromfile(path), demo_form(path)
    for key in ('optim_wrapper', 'param_scheduler', 'train_cfg', 'default_hooks'):
        assert cfg[key] == stock[key], key
    assert cfg.train_cfg.max_iters == 300 and cfg.optim_wrapper.optimizer.lr == 1e-3
    assert cfg.train_dataloader.dataset.data_root == 'data/demo/coco/'
    assert cfg.train_dataloader.sampler.type == 'InfiniteSampler'  # merged, not replaced
    assert cfg.model.train_cfg.rcnn.sampler.num == 128


@pytest.mark.parametrize('rel', [
    'poly/cascade-mask-rcnn_r50-polynl_fpn_ms-3x_coco.py',
    'setformer/fpn_setformer-t_8xb4-40k_ade20k-512x512.py',
    'pvtv2/pvtv2-b0_in1k.py',
    'polaformer/mask-rcnn_pola-nat-tiny_fpn_300it_coco.py',
])
def test_written_config_is_the_overlay(rel, tmp_path):
    """``python -m linattn_mm.demo`` (for mim and the stock tools) writes the same config as
    ``--demo`` runs."""
    out = tmp_path / 'demo.py'
    out.write_text(demo_config_text(_cfg(rel)))
    assert out.read_text().splitlines()[3] == f'_base_ = [{_cfg(rel)!r}]'
    assert Config.fromfile(str(out)).to_dict() == demo_form(_cfg(rel)).to_dict()


def test_cli_writes_the_config_of_a_zoo_name(tmp_path, monkeypatch, capsys):
    from linattn_mm.demo.__main__ import main
    monkeypatch.chdir(tmp_path)
    main(['pvtv2-b0_in1k', '--data-root', '/abs/demo'])
    out = tmp_path / 'pvtv2-b0_in1k_demo.py'
    assert capsys.readouterr().out.strip() == 'pvtv2-b0_in1k_demo.py' and out.is_file()
    cfg = Config.fromfile(str(out))
    assert cfg.train_dataloader.dataset.data_root == '/abs/demo/imagenet'
    assert cfg.model.backbone.type == 'LinAttnPVTv2'


def test_tools_apply_it_before_cfg_options(demo_data):
    from linattn_mm.cli import add_common_args, load_config, parse_with_common
    parser = argparse.ArgumentParser()
    parser.add_argument('config')
    args = parse_with_common(add_common_args(parser), [
        _cfg('pvtv2/pvtv2-b0_in1k.py'), '--demo', '--cfg-options', 'train_cfg.max_epochs=1'])
    cfg = load_config(args)
    assert cfg.train_dataloader.dataset.data_root == 'data/demo/imagenet'
    assert cfg.train_cfg.max_epochs == 1
    assert cfg.work_dir == osp.join('./work_dirs', 'pvtv2-b0_in1k_demo')
    args.demo = False
    assert load_config(args).work_dir == osp.join('./work_dirs', 'pvtv2-b0_in1k')


def test_options_that_set_a_pretrained_file_apply_on_the_configs_own_init_cfg(demo_data, tmp_path,
                                                                             monkeypatch):
    """The overlay drops the backbone's pretrained file (init_cfg None); an option that sets one
    (the README's way for patchify-stem backbones on the demo data) starts from the config's own
    init_cfg, where merging into None failed."""
    from linattn_mm.cli import add_common_args, load_config, parse_with_common
    parser = argparse.ArgumentParser()
    parser.add_argument('config')
    parser = add_common_args(parser)
    path = _cfg('polaformer/mask-rcnn_pola-pvt-t_fpn_1x_coco.py')
    args = parse_with_common(parser, [path, '--demo'])
    assert load_config(args).model.backbone.init_cfg is None
    args = parse_with_common(parser, [
        path, '--demo', '--cfg-options', 'model.backbone.init_cfg.checkpoint=pvt_t.pth'])
    assert load_config(args).model.backbone.init_cfg == dict(type='Pretrained',
                                                             checkpoint='pvt_t.pth')
    args = parse_with_common(parser, ['configs/nope.py'])
    with pytest.raises(SystemExit, match="error: no config file 'configs/nope.py'"):
        load_config(args)
    # a model-zoo name stands for its config file, as in get_model; a misspelt one is named
    args = parse_with_common(parser, ['pola-pvt-t_in1k'])
    cfg = load_config(args)
    assert osp.samefile(args.config, _cfg('polaformer/pola-pvt-t_in1k.py'))
    assert cfg.work_dir == './work_dirs/pola-pvt-t_in1k'
    assert cfg.model.backbone.type == 'LinAttnPVT'
    args = parse_with_common(parser, ['pola-pvt-t-in1k'])
    with pytest.raises(SystemExit, match=r"error: no config file 'pola-pvt-t-in1k', nor a "
                                         r"model-zoo name: unknown model .*similar: "
                                         r"\['pola-pvt-t_in1k'"):
        load_config(args)
    monkeypatch.chdir(tmp_path)  # no data/demo here: --demo says what to run
    args = parse_with_common(parser, [path, '--demo'])
    with pytest.raises(SystemExit, match=r'--demo trains and tests on the generated demo data in '
                                         r'data/demo/ .* run python tools/make_demo_data.py'):
        load_config(args)


def test_configs_it_cannot_take():
    cfg = Config.fromfile(_cfg('swin/mask-rcnn_swin-t_fpn_1x_coco.py'))
    voc = copy.deepcopy(cfg)
    voc.merge_from_dict({'train_dataloader.dataset.type': 'VOCDataset'})
    with pytest.raises(ValueError, match=r'train_dataloader.dataset is a VOCDataset: the demo '
                       r'data of mmdet configs is in the layout of CocoDataset'):
        apply_demo(voc)
    other = copy.deepcopy(cfg)
    other.default_scope = 'mmocr'
    with pytest.raises(ValueError, match="got default_scope 'mmocr'"):
        apply_demo(other)
    keep = copy.deepcopy(cfg)
    keep.demo_keep = ['train_cfg', 'work_dir']
    with pytest.raises(ValueError, match=r"demo_keep names \['work_dir'\], which the demo overlay "
                       'does not set'):
        apply_demo(keep)
    keep.demo_keep = 'train_cfg'
    with pytest.raises(ValueError, match='demo_keep must be a list of top-level config keys'):
        apply_demo(keep)
