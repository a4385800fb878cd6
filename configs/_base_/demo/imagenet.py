# Demo-data settings for ImageNet classifiers (mmpretrain). `python tools/make_demo_data.py` writes
# a 4-class subset in the standard ImageNet layout (train/, val/, meta/*.txt) under
# data/demo/imagenet. Only `demo_*` names are defined here; a demo config assigns them.
demo_data_root = 'data/demo/imagenet'
demo_train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RandomResizedCrop', scale=64),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='PackInputs'),
]
demo_test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='ResizeEdge', scale=64, edge='short'),
    dict(type='CenterCrop', crop_size=64),
    dict(type='PackInputs'),
]
demo_train_dataloader = dict(
    batch_size=8, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=demo_data_root, pipeline=demo_train_pipeline))
demo_val_dataloader = dict(
    batch_size=8, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=demo_data_root, pipeline=demo_test_pipeline))
demo_max_epochs = 10
demo_train_cfg = dict(max_epochs=demo_max_epochs, val_interval=demo_max_epochs)
demo_param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=10),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=0, end=demo_max_epochs),
]
demo_optim_wrapper = dict(optimizer=dict(lr=5e-4))
demo_default_hooks = dict(
    logger=dict(interval=10), checkpoint=dict(interval=demo_max_epochs, max_keep_ckpts=2))
demo_model = dict(backbone=dict(init_cfg=None))
