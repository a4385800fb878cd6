"""``tools/train.py --pola-core``: :func:`linattn_mm.cli.set_pola_core` puts every Pola mixer of
a config on the named core (every stage of a per-stage ``attn_cfg`` list, a single ``attn_cfg``
dict), the model built from it has those cores, and configs without Pola mixers or unknown core
names are refused with the reason."""
import os.path as osp

import pytest
from harness import CONFIGS
from mmengine.config import Config

import linattn_mm  # noqa: F401  (registers the backbones)
from linattn_mm.cli import set_pola_core
from linattn_mm.models.attentions.pola import PolaLinearAttention
from linattn_mm.models.attentions.softmax import WindowSoftmaxAttention



def _config(rel):
    return Config.fromfile(osp.join(CONFIGS, rel))


def test_per_stage_list_and_the_built_backbone():
    from mmdet.registry import MODELS
    cfg = _config('polaformer/mask-rcnn_pola-swin-t_fpn_1x_coco.py')
    assert set_pola_core(cfg, 'triton') == 2  # global Pola stages 1-2; windows 3-4 untouched
    stages = cfg.model.backbone.attn_cfg
    assert [a.get('core') for a in stages] == ['triton', 'triton', None, None]
    backbone = dict(cfg.model.backbone, init_cfg=None,
                    arch=dict(embed_dims=16, depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 2]))
    net = MODELS.build(backbone)
    pola = [m for m in net.modules() if isinstance(m, PolaLinearAttention)]
    windows = [m for m in net.modules() if isinstance(m, WindowSoftmaxAttention)]
    assert len(pola) == 2 and all(m.core == 'triton' for m in pola)
    assert len(windows) == 2


def test_single_attn_cfg_and_back_to_the_default():
    cfg = _config('polaformer/mask-rcnn_pola-pvt-t_fpn_1x_coco.py')
    assert set_pola_core(cfg, 'triton') == 1
    assert cfg.model.backbone.attn_cfg.core == 'triton'
    assert set_pola_core(cfg, 'fast') == 1
    assert cfg.model.backbone.attn_cfg.core == 'fast'


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match='names no PolaLinearAttention'):
        set_pola_core(_config('swin/mask-rcnn_swin-t_fpn_1x_coco.py'), 'triton')
    with pytest.raises(ValueError, match='core must be one of'):
        set_pola_core(_config('polaformer/mask-rcnn_pola-pvt-t_fpn_1x_coco.py'), 'cuda')
