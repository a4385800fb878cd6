# retinanet_poly-pvt-t_fpn_1x_coco on the generated demo data with a tiny schedule (same model, no pretrained weights).
_base_ = ['./retinanet_poly-pvt-t_fpn_1x_coco.py', '../_base_/demo/coco_instance.py']
train_dataloader = {{_base_.demo_train_dataloader}}
val_dataloader = {{_base_.demo_val_dataloader}}
test_dataloader = {{_base_.demo_val_dataloader}}
val_evaluator = {{_base_.demo_val_evaluator}}
test_evaluator = {{_base_.demo_val_evaluator}}
train_cfg = {{_base_.demo_train_cfg}}
param_scheduler = {{_base_.demo_param_scheduler}}
optim_wrapper = {{_base_.demo_optim_wrapper}}
default_hooks = {{_base_.demo_default_hooks}}
model = {{_base_.demo_model}}
