# cascade-mask-rcnn_setformer-t_fpn_ms-crop-3x_coco on the generated demo data with a tiny schedule
# (no pretrained file). Same model except num_refs=64 SeT references instead of 750 (m=750
# costs ~20 s per CPU training step at 160x160).
_base_ = [
    './cascade-mask-rcnn_setformer-t_fpn_ms-crop-3x_coco.py',
    '../_base_/demo/coco_instance.py'
]
train_dataloader = {{_base_.demo_train_dataloader}}
val_dataloader = {{_base_.demo_val_dataloader}}
test_dataloader = {{_base_.demo_val_dataloader}}
val_evaluator = {{_base_.demo_val_evaluator}}
test_evaluator = {{_base_.demo_val_evaluator}}
train_cfg = {{_base_.demo_train_cfg}}
param_scheduler = {{_base_.demo_param_scheduler}}
optim_wrapper = {{_base_.demo_optim_wrapper}}
default_hooks = {{_base_.demo_default_hooks}}
model = dict(backbone=dict(init_cfg=None, attn_cfg=dict(num_refs=64)))
