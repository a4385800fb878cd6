"""The demo overlay: any mmdet, mmseg or mmpretrain config on the generated demo data.

:func:`demo_patch` returns what the overlay changes in a config, as a partial config with the
semantics of config inheritance (dicts merge, lists and other values replace):

* **data** -- the dataloaders and the COCO evaluator point at the demo data under ``data_root``
  (``python tools/make_demo_data.py`` writes it in the standard COCO, ADEChallengeData2016 and
  ImageNet layouts), with small images (160x160 for COCO, 128x128 crops for ADE20K, 64x64 for
  ImageNet) and no dataloader workers; a ``RepeatDataset`` around the training set repeats it once;
* **schedule** -- 12 epochs (COCO), 400 iterations (ADE20K) or 10 epochs (ImageNet), a short
  warm-up, the learning rate of the demo (by optimizer: SGD recipes keep a larger step than the
  adaptive ones), a log line every 10 iterations, a checkpoint at the end;
* **model** -- no pretrained backbone file (``init_cfg=None``: the demo trains from scratch and
  downloads nothing), and the CPU settings: two-stage detectors with one RoI head sample fewer
  proposals and RoIs per image, SeT attention uses 64 references, a segmentor's data
  preprocessor pads to the demo crop. The architecture is otherwise unchanged.

A config that brings its own short schedule lists the top-level keys the overlay must leave alone
in ``demo_keep`` (e.g. ``demo_keep = ['optim_wrapper', 'param_scheduler', 'train_cfg',
'default_hooks']``).

The same function is behind every route: ``tools/train.py CONFIG --demo``, ``tools/test.py CONFIG
CHECKPOINT --demo``, ``tools/browse_dataset.py CONFIG --demo``, ``tools/demo.sh [CONFIG]``, and
``python -m linattn_mm.demo CONFIG -o FILE``, which writes a one-file config (``_base_`` = CONFIG
plus the patch) for the stock OpenMMLab tools and ``mim``.
"""
import copy
import os.path as osp

from . import ade

#: where ``tools/make_demo_data.py`` writes the demo data by default (relative to the working dir)
DEMO_ROOT = 'data/demo'
SCOPES = ('mmdet', 'mmseg', 'mmpretrain')
#: the dataset class each library's configs must use: the layout of the demo data
DATASETS = {'mmdet': 'CocoDataset', 'mmseg': 'ADE20KDataset', 'mmpretrain': 'ImageNet'}
_LOADER = dict(num_workers=0, persistent_workers=False)


def _coco(root):
    data_root = f'{root}/coco/'
    scale = (160, 160)
    epochs = 12
    return dict(
        data_root=data_root,
        train_pipeline=[
            dict(type='LoadImageFromFile'),
            dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
            dict(type='Resize', scale=scale, keep_ratio=True),
            dict(type='RandomFlip', prob=0.5),
            dict(type='PackDetInputs'),
        ],
        test_pipeline=[
            dict(type='LoadImageFromFile'),
            dict(type='Resize', scale=scale, keep_ratio=True),
            dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
            dict(type='PackDetInputs',
                 meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
        ],
        train_batch=4, val_batch=1,
        evaluator=dict(ann_file=data_root + 'annotations/instances_val2017.json'),
        train_cfg=dict(max_epochs=epochs, val_interval=epochs),
        param_scheduler=[
            dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=20),
            dict(type='MultiStepLR', begin=0, end=epochs, by_epoch=True, milestones=[9, 11],
                 gamma=0.1),
        ],
        lr=dict(adaptive=2e-4, sgd=0.01),
        checkpoint_interval=epochs,
        # two-stage detectors on CPU: fewer proposals and sampled RoIs per image
        two_stage=dict(rpn_proposal=dict(nms_pre=600, max_per_img=300),
                       rcnn=dict(sampler=dict(num=128))),
        set_refs=64,
        model={})


def _ade(root):
    data_root = f'{root}/ade/{ade.DATA_SUB}'
    crop = (128, 128)
    iters = 400
    return dict(
        data_root=data_root,
        train_pipeline=[
            dict(type='LoadImageFromFile'),
            dict(type='LoadAnnotations', reduce_zero_label=True),
            dict(type='RandomResize', scale=(256, 128), ratio_range=(0.75, 1.5), keep_ratio=True),
            dict(type='RandomCrop', crop_size=crop, cat_max_ratio=0.75),
            dict(type='RandomFlip', prob=0.5),
            dict(type='PackSegInputs'),
        ],
        test_pipeline=[
            dict(type='LoadImageFromFile'),
            dict(type='Resize', scale=(256, 128), keep_ratio=True),
            dict(type='LoadAnnotations', reduce_zero_label=True),
            dict(type='PackSegInputs'),
        ],
        train_batch=4, val_batch=1, evaluator=None,
        train_cfg=dict(max_iters=iters, val_interval=iters),
        param_scheduler=[
            dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=20),
            dict(type='PolyLR', power=1.0, eta_min=0.0, by_epoch=False, begin=20, end=iters),
        ],
        lr=dict(adaptive=2e-4, sgd=0.01),
        checkpoint_interval=iters, two_stage=None, set_refs=64,
        model=dict(data_preprocessor=dict(size=crop)))


def _imagenet(root):
    epochs = 10
    return dict(
        data_root=f'{root}/imagenet',
        train_pipeline=[
            dict(type='LoadImageFromFile'),
            dict(type='RandomResizedCrop', scale=64),
            dict(type='RandomFlip', prob=0.5, direction='horizontal'),
            dict(type='PackInputs'),
        ],
        test_pipeline=[
            dict(type='LoadImageFromFile'),
            dict(type='ResizeEdge', scale=64, edge='short'),
            dict(type='CenterCrop', crop_size=64),
            dict(type='PackInputs'),
        ],
        train_batch=8, val_batch=8, evaluator=None,
        train_cfg=dict(max_epochs=epochs, val_interval=epochs),
        param_scheduler=[
            dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=10),
            dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=0, end=epochs),
        ],
        lr=dict(adaptive=5e-4, sgd=0.05),
        checkpoint_interval=epochs, two_stage=None, set_refs=None, model={})


#: the demo values of each library's configs, given the demo data root
SETTINGS = {'mmdet': _coco, 'mmseg': _ade, 'mmpretrain': _imagenet}


def _train_dataset(loader, scope, name, data):
    """The training set's part of the patch; a ``RepeatDataset`` wrapper repeats it once."""
    ds = loader.get('dataset') or {}
    patch = dict(data_root=data['data_root'], pipeline=data['train_pipeline'])
    if ds.get('type') == 'RepeatDataset':
        _check_dataset(ds.get('dataset') or {}, scope, f'{name}.train_dataloader.dataset.dataset')
        return dict(times=1, dataset=patch)
    _check_dataset(ds, scope, f'{name}.train_dataloader.dataset')
    return patch


def _check_dataset(ds, scope, where):
    kind = str(ds.get('type', '')).split('.')[-1]
    if kind != DATASETS[scope]:
        raise ValueError(
            f'{where} is a {kind or "dataset without a type"}: the demo data of {scope} configs '
            f'is in the layout of {DATASETS[scope]} (a RepeatDataset around it is accepted)')


def demo_patch(cfg, data_root=DEMO_ROOT):
    """What the demo overlay changes in ``cfg`` (an :class:`mmengine.Config`): a dict of top-level
    keys whose values merge into the config like a child config's (see the module docstring).

    Args:
        cfg (Config): a loaded mmdet / mmseg / mmpretrain config.
        data_root (str): the folder ``tools/make_demo_data.py`` wrote (default ``data/demo``,
            relative to the working directory of the run).
    """
    name = osp.basename(getattr(cfg, 'filename', None) or 'the config')
    scope = cfg.get('default_scope')
    if scope not in SETTINGS:
        raise ValueError(f'{name}: the demo overlay takes mmdet, mmseg and mmpretrain configs '
                         f'(default_scope one of {SCOPES}), got default_scope {scope!r}')
    data = SETTINGS[scope](str(data_root).rstrip('/'))
    for key in ('train_dataloader', 'val_dataloader', 'test_dataloader', 'model',
                'optim_wrapper', 'train_cfg', 'default_hooks'):
        if not isinstance(cfg.get(key), dict):
            raise ValueError(f'{name}: the demo overlay needs a {key} dict in the config')
    test_loader = dict(batch_size=data['val_batch'], **_LOADER,
                       dataset=dict(data_root=data['data_root'], pipeline=data['test_pipeline']))
    for split in ('val', 'test'):
        _check_dataset(cfg[f'{split}_dataloader'].get('dataset') or {}, scope,
                       f'{name}.{split}_dataloader.dataset')
    patch = dict(
        train_dataloader=dict(batch_size=data['train_batch'], **_LOADER,
                              dataset=_train_dataset(cfg.train_dataloader, scope, name, data)),
        val_dataloader=test_loader, test_dataloader=copy.deepcopy(test_loader))
    if data['evaluator'] is not None:
        for split in ('val', 'test'):
            if not isinstance(cfg.get(f'{split}_evaluator'), dict):
                raise ValueError(f'{name}: the demo overlay needs one {split}_evaluator dict '
                                 f'(the COCO metric), got {cfg.get(f"{split}_evaluator")!r}')
            patch[f'{split}_evaluator'] = copy.deepcopy(data['evaluator'])
    optimizer = cfg.optim_wrapper.get('optimizer') or {}
    sgd = str(optimizer.get('type', '')).split('.')[-1] == 'SGD'
    patch.update(
        train_cfg=data['train_cfg'],
        param_scheduler=data['param_scheduler'],
        optim_wrapper=dict(optimizer=dict(lr=data['lr']['sgd' if sgd else 'adaptive'])),
        default_hooks=dict(logger=dict(interval=10),
                           checkpoint=dict(interval=data['checkpoint_interval'],
                                           max_keep_ckpts=2)),
        model=_model_patch(cfg.model, data))
    # the top-level pipelines too: mmseg's inference_model (and other readers of the config)
    # take cfg.test_pipeline, not the dataloader's copy
    for key in ('train_pipeline', 'test_pipeline'):
        if isinstance(cfg.get(key), list):
            patch[key] = copy.deepcopy(data[key])
    return _without_kept(cfg, patch, name)


def _model_patch(model, data):
    patch = copy.deepcopy(data['model'])
    backbone = patch.setdefault('backbone', {})
    backbone['init_cfg'] = None
    attn = (model.get('backbone') or {}).get('attn_cfg')
    if data['set_refs'] and isinstance(attn, dict) and attn.get('type') == 'SeTAttention':
        backbone['attn_cfg'] = dict(num_refs=data['set_refs'])
    train_cfg = model.get('train_cfg') or {}
    if data['two_stage'] and 'rpn_proposal' in train_cfg and isinstance(
            train_cfg.get('rcnn'), dict):
        patch['train_cfg'] = copy.deepcopy(data['two_stage'])
    return patch


def _without_kept(cfg, patch, name):
    keep = cfg.get('demo_keep') or []
    if isinstance(keep, str) or not all(isinstance(k, str) for k in keep):
        raise ValueError(f'{name}: demo_keep must be a list of top-level config keys, got {keep!r}')
    unknown = sorted(set(keep) - set(patch))
    if unknown:
        raise ValueError(f'{name}: demo_keep names {unknown}, which the demo overlay does not set '
                         f'(it sets {sorted(patch)})')
    return {k: v for k, v in patch.items() if k not in keep}


def apply_demo(cfg, data_root=DEMO_ROOT):
    """Apply the demo overlay to ``cfg`` (in place) and return it."""
    cfg.merge_from_dict(demo_patch(cfg, data_root))
    return cfg


def demo_config_text(config, data_root=DEMO_ROOT):
    """The text of a one-file config that inherits ``config`` (a config file or a model-zoo name)
    and applies the demo overlay: what ``python -m linattn_mm.demo`` writes."""
    from linattn_mm.apis import get_config
    cfg = get_config(config)
    path = osp.abspath(cfg.filename)
    lines = [f'# {osp.basename(path)} on the generated demo data under {data_root}',
             '# (python tools/make_demo_data.py), written by linattn_mm.demo: the data, schedule and',
             '# CPU settings of the demo overlay.',
             f'_base_ = [{path!r}]']
    for key, value in demo_patch(cfg, data_root).items():
        lines.append(f'{key} = ' + _literal(value, 0, len(key) + 3))
    return '\n'.join(lines) + '\n'


def _flat(value):
    if isinstance(value, dict) and all(str(k).isidentifier() for k in value):
        return 'dict(' + ', '.join(f'{k}={_flat(v)}' for k, v in value.items()) + ')'
    if isinstance(value, dict):
        return '{' + ', '.join(f'{k!r}: {_flat(v)}' for k, v in value.items()) + '}'
    if isinstance(value, list):
        return '[' + ', '.join(_flat(v) for v in value) + ']'
    if isinstance(value, tuple):
        return '(' + ', '.join(_flat(v) for v in value) + (',)' if len(value) == 1 else ')')
    return repr(value)


def _literal(value, indent, prefix, width=100):
    """``value`` as config-file Python (``dict(k=v)``), one item per line where the line would
    exceed ``width`` (``prefix``: characters before it on its first line)."""
    flat = _flat(value)
    nested = isinstance(value, list) or (
        isinstance(value, dict) and all(str(k).isidentifier() for k in value))
    if indent + prefix + len(flat) <= width or not nested or not value:
        return flat
    inner = indent + 4
    if isinstance(value, dict):
        items = [f'{k}=' + _literal(v, inner, len(k) + 2, width) for k, v in value.items()]
        head, tail = 'dict(', ')'
    else:
        items = [_literal(v, inner, 1, width) for v in value]
        head, tail = '[', ']'
    return head + '\n' + ''.join(' ' * inner + it + ',\n' for it in items) + ' ' * indent + tail


def write_demo_config(config, out, data_root=DEMO_ROOT):
    """Write :func:`demo_config_text` of ``config`` to ``out``; returns ``out``."""
    import os
    text = demo_config_text(config, data_root)
    if osp.dirname(out):
        os.makedirs(osp.dirname(out), exist_ok=True)
    with open(out, 'w') as f:
        f.write(text)
    return out
