# fpn_setformer-t_8xb4-40k_ade20k-512x512 on the generated demo data with a tiny schedule (no
# pretrained file). Same model except num_refs=64 SeT references instead of 800 (CPU time).
_base_ = ['./fpn_setformer-t_8xb4-40k_ade20k-512x512.py', '../_base_/demo/ade20k.py']
train_dataloader = dict(
    batch_size=4, num_workers=0, persistent_workers=False,
    dataset=dict(times=1, dataset={{_base_.demo_train_dataset}}))
val_dataloader = {{_base_.demo_val_dataloader}}
test_dataloader = {{_base_.demo_val_dataloader}}
train_cfg = {{_base_.demo_train_cfg}}
param_scheduler = {{_base_.demo_param_scheduler}}
optim_wrapper = {{_base_.demo_optim_wrapper}}
default_hooks = {{_base_.demo_default_hooks}}
model = dict(backbone=dict(init_cfg=None, attn_cfg=dict(num_refs=64)),
             data_preprocessor=dict(size={{_base_.demo_crop_size}}))
