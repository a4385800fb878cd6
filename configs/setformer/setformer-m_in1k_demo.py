# setformer-m_in1k on the generated 4-class demo subset of ImageNet with a tiny schedule (same
# model: m=500 references, 30 Sinkhorn iterations).
_base_ = ['./setformer-m_in1k.py', '../_base_/demo/imagenet.py']
train_dataloader = {{_base_.demo_train_dataloader}}
val_dataloader = {{_base_.demo_val_dataloader}}
test_dataloader = {{_base_.demo_val_dataloader}}
train_cfg = {{_base_.demo_train_cfg}}
param_scheduler = {{_base_.demo_param_scheduler}}
optim_wrapper = {{_base_.demo_optim_wrapper}}
default_hooks = {{_base_.demo_default_hooks}}
model = {{_base_.demo_model}}
