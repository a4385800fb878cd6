# NaLa-Swin-T ImageNet-1k classifier: the paper's Swin-T protocol (Table 6, the FLatten-Transformer
# setting): norm-aware linear attention, global over the whole map, in stages 1-2 (window 56 at 224,
# i.e. no windows) and Swin window attention (7x7, shifted) in stages 3-4; Swin recipe (AdamW lr
# 1e-3 / 1024, 300 epochs, 20 warm-up epochs, drop path 0.2). Paper: 29M / 4.8G / 82.9.
_base_ = ['mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py', '../_base_/safe_checkpoints.py']
custom_imports = dict(imports=['linattn_mm'], allow_failed_imports=False)
nala = dict(type='NormAwareLinearAttention')
window = dict(type='WindowSoftmaxAttention', window_size=7)
model = dict(
    backbone=dict(
        _delete_=True,
        type='LinAttnSwin',
        arch='t',
        attn_cfg=[nala, nala, window, window],
        drop_path_rate=0.2,
        out_indices=(3, )),
    head=dict(in_channels=768))
