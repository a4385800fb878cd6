"""Small instances of every backbone family and of the linear mixers in the NAT-style hierarchy
(one or two blocks per stage), shared by the size, AMP and checkpoint tests: name -> builder."""
import linattn_mm  # noqa: F401
from linattn_mm.models.backbones import LinAttnPVT, LinAttnPVTv2, LinAttnSwin, LinAttnViT
from linattn_mm.models.backbones.nalaformer import NaLaFormer
from linattn_mm.models.backbones.resnet_polynl import PolyNLResNet
from linattn_mm.models.backbones.setformer import SeTformer

PVT = dict(embed_dims=[16, 32, 40, 64], depths=[1, 1, 1, 1], num_heads=[1, 2, 5, 8],
           mlp_ratios=[2, 2, 2, 2], sr_ratios=[8, 4, 2, 1])
SWIN = dict(embed_dims=16, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4])
HIER = dict(embed_dims=[16, 32, 64, 64], depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 4],
            mlp_ratios=[2, 2, 2, 2])

FAMILIES = {
    'pvt-softmax': lambda: LinAttnPVT(arch=PVT),
    'pvtv2-softmax': lambda: LinAttnPVTv2(arch=PVT),
    'swin-softmax': lambda: LinAttnSwin(arch=SWIN),
    'deit-softmax': lambda: LinAttnViT(arch=dict(embed_dims=32, depth=4, num_heads=2)),
    'pola-pvt': lambda: LinAttnPVT(arch=PVT, attn_cfg=dict(type='PolaLinearAttention')),
    'pola-swin': lambda: LinAttnSwin(arch=SWIN, attn_cfg=[
        dict(type='PolaLinearAttention', qkv_layout='qkvg')] * 2 + [
        dict(type='WindowSoftmaxAttention', window_size=7)] * 2),
    'nalaformer': lambda: NaLaFormer(arch=HIER),
    'padre-swin': lambda: LinAttnSwin(arch=SWIN, attn_cfg=dict(type='PADReMixer')),
    'poly-swin': lambda: LinAttnSwin(arch=SWIN, attn_cfg=dict(type='PolySelfAttention',
                                                              window_size=7)),
    'poly-pvt': lambda: LinAttnPVT(arch=PVT, attn_cfg=dict(type='PolySelfAttention')),
    'poly-deit': lambda: LinAttnViT(arch=dict(embed_dims=32, depth=4, num_heads=2),
                                    attn_cfg=dict(type='PolySelfAttention')),
    'setformer': lambda: SeTformer(arch=dict(embed_dims=16, depths=[1, 1, 1, 1],
                                             num_heads=[1, 2, 2, 4], mlp_ratio=2), attn_cfg=dict(
        type='SeTAttention', num_refs=16, num_iters=5)),
    'r50-polynl': lambda: PolyNLResNet(),
}
# any mixer in any skeleton: the linear families in the NAT-style (SeTformer) hierarchy, as the
# learning check trains them
NAT = dict(embed_dims=16, depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 4], mlp_ratio=2)
for _name, _attn in (('pola', dict(type='PolaLinearAttention', qkv_layout='qkvg')),
                     ('nala', dict(type='NormAwareLinearAttention')),
                     ('padre', dict(type='PADReMixer')),
                     ('poly', dict(type='PolySelfAttention'))):
    FAMILIES[f'{_name}-nat'] = lambda _attn=_attn: SeTformer(arch=NAT, attn_cfg=_attn)
PLAIN = {'deit-softmax', 'poly-deit'}
