# cascade-mask-rcnn_r50-polynl_fpn_ms-3x_coco on the generated demo data with a tiny schedule (same model, no pretrained weights).
_base_ = ['./cascade-mask-rcnn_r50-polynl_fpn_ms-3x_coco.py', '../_base_/demo/coco_instance.py']
# the stock 3x recipe wraps the training set in a RepeatDataset (times=3): the demo repeats it once
train_dataloader = dict(
    batch_size=4, num_workers=0, persistent_workers=False,
    dataset=dict(times=1, dataset=dict(data_root={{_base_.demo_data_root}},
                                       pipeline={{_base_.demo_train_pipeline}})))
val_dataloader = {{_base_.demo_val_dataloader}}
test_dataloader = {{_base_.demo_val_dataloader}}
val_evaluator = {{_base_.demo_val_evaluator}}
test_evaluator = {{_base_.demo_val_evaluator}}
train_cfg = {{_base_.demo_train_cfg}}
param_scheduler = {{_base_.demo_param_scheduler}}
optim_wrapper = dict(optimizer=dict(lr=0.01))  # the stock SGD recipe, a larger step than the AdamW demos
default_hooks = {{_base_.demo_default_hooks}}
model = {{_base_.demo_model}}
