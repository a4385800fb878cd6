# Demo-data settings for ADE20K segmentors (Semantic FPN, UperNet). `python tools/make_demo_data.py`
# writes the data in the standard ADEChallengeData2016 layout under data/demo/ade. Only `demo_*`
# names are defined here; a demo config assigns them to the stock keys.
demo_data_root = 'data/demo/ade/ADEChallengeData2016'
demo_crop_size = (128, 128)
demo_train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomResize', scale=(256, 128), ratio_range=(0.75, 1.5), keep_ratio=True),
    dict(type='RandomCrop', crop_size=demo_crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs'),
]
demo_test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(256, 128), keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs'),
]
demo_train_dataset = dict(data_root=demo_data_root, pipeline=demo_train_pipeline)
demo_val_dataloader = dict(
    batch_size=1, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=demo_data_root, pipeline=demo_test_pipeline))
demo_max_iters = 400
demo_train_cfg = dict(max_iters=demo_max_iters, val_interval=demo_max_iters)
demo_param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=20),
    dict(type='PolyLR', power=1.0, eta_min=0.0, by_epoch=False, begin=20, end=demo_max_iters),
]
demo_optim_wrapper = dict(optimizer=dict(lr=2e-4))
demo_default_hooks = dict(
    logger=dict(interval=10), checkpoint=dict(interval=demo_max_iters, max_keep_ckpts=2))
demo_model = dict(backbone=dict(init_cfg=None), data_preprocessor=dict(size=demo_crop_size))
