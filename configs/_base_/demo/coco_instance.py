# Demo-data settings for COCO detectors (Mask R-CNN, RetinaNet, Cascade Mask R-CNN).
# `python tools/make_demo_data.py` writes the data in the standard COCO layout under
# data/demo/coco. Only `demo_*` names are defined here: a demo config assigns them to the stock
# keys, so the model and the rest of the stock config stay the same.
demo_data_root = 'data/demo/coco/'
demo_img_scale = (160, 160)
demo_train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=demo_img_scale, keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
demo_test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=demo_img_scale, keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
demo_train_dataloader = dict(
    batch_size=4, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=demo_data_root, pipeline=demo_train_pipeline))
demo_val_dataloader = dict(
    batch_size=1, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=demo_data_root, pipeline=demo_test_pipeline))
demo_val_evaluator = dict(ann_file=demo_data_root + 'annotations/instances_val2017.json')
demo_max_epochs = 12
demo_train_cfg = dict(max_epochs=demo_max_epochs, val_interval=demo_max_epochs)
demo_param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=20),
    dict(type='MultiStepLR', begin=0, end=demo_max_epochs, by_epoch=True, milestones=[9, 11],
         gamma=0.1),
]
demo_optim_wrapper = dict(optimizer=dict(lr=2e-4))
demo_default_hooks = dict(
    logger=dict(interval=10), checkpoint=dict(interval=demo_max_epochs, max_keep_ckpts=2))
demo_model = dict(backbone=dict(init_cfg=None))
# Two-stage detectors on CPU: fewer proposals and sampled RoIs per image (the model is unchanged).
demo_two_stage_model = dict(
    backbone=dict(init_cfg=None),
    train_cfg=dict(rpn_proposal=dict(nms_pre=600, max_per_img=300), rcnn=dict(sampler=dict(num=128))))
