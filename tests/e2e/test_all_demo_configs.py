"""Every config of the model zoo, put on the demo data by the demo overlay (``--demo``), trains one
iteration and tests with metrics, through tools/train.py and tools/test.py (run in this process to
save start-up time); the ImageNet variants listed in ``IN1K_VARIANTS`` are built in their demo form
and run forward instead."""
import os.path as osp

import pytest
import torch
from harness import demo_form, train_and_test_inprocess

import linattn_mm
from linattn_mm.apis import _zoo, build_model

CONFIGS = linattn_mm.list_models()
DEMO_ROOT = 'data/demo/'
# ImageNet variants (larger sizes, higher PADRe degrees) of a skeleton and mixer that train here at
# another setting of the same family, e.g. swin-s/b next to swin-t_in1k: one training iteration of
# each would add minutes (up to 35 s for PVTv2-b5 on 2 CPU cores) to a file that trains 109 configs.
# A config trains unless it is listed here.
IN1K_VARIANTS = {
    'deit-s_in1k', 'deit-b_in1k', 'nala-pvt-s_in1k', 'nalaformer-s_in1k', 'nalaformer-b_in1k',
    'nalaformer-l_in1k', 'padre-pvt-s_in1k', 'padre2-deit-s_in1k', 'padre2-deit-b_in1k',
    'padre3-deit-t_in1k', 'padre3-deit-s_in1k', 'padre4-deit-t_in1k', 'poly-deit-s_in1k',
    'poly-pvt-s_in1k', 'poly-swin-s_in1k', 'pvt-s_in1k', 'pvt-m_in1k', 'pvt-l_in1k',
    'pvtv2-b1_in1k', 'pvtv2-b2_in1k', 'pvtv2-b3_in1k', 'pvtv2-b4_in1k', 'pvtv2-b5_in1k',
    'setformer-t_in1k', 'setformer-s_in1k', 'setformer-b_in1k', 'swin-s_in1k', 'swin-b_in1k',
}
TRAINED = [n for n in CONFIGS if n not in IN1K_VARIANTS]


@pytest.mark.parametrize('name', TRAINED)
def test_demo_form_trains_and_tests(name, demo_data, fast_config_text, tmp_path):
    metrics, keys = train_and_test_inprocess(_zoo()[name], str(tmp_path / 'work'), demo=True)
    for k in keys:
        assert k in metrics, (k, metrics)
        assert 0.0 <= metrics[k] <= 100.0, (k, metrics[k])


@pytest.mark.parametrize('name', sorted(IN1K_VARIANTS))
def test_in1k_variant_builds_and_runs(name):
    """The demo form of the classifier builds and gives finite logits for a demo-sized image."""
    cfg = demo_form(_zoo()[name])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        logits = model(torch.randn(2, 3, 64, 64), mode='tensor')
    assert logits.shape == (2, 1000) and torch.isfinite(logits).all()  # ImageNet-1k classes


def _skeleton_and_mixer(name):
    backbone = demo_form(_zoo()[name]).model.backbone
    attn = backbone.get('attn_cfg')
    attn = attn if isinstance(attn, list) else [attn or {}]
    return backbone.type, tuple(a.get('type') for a in attn), str(backbone.get('attn_types'))


def test_in1k_variants_have_a_trained_relative():
    """Each listed variant is an ImageNet config whose skeleton and mixer train here in another
    ImageNet config of its folder."""
    assert IN1K_VARIANTS <= set(CONFIGS), IN1K_VARIANTS - set(CONFIGS)
    for name in sorted(IN1K_VARIANTS):
        assert name.endswith('_in1k'), name
        folder = osp.dirname(_zoo()[name])
        kin = [n for n in TRAINED if n.endswith('_in1k') and osp.dirname(_zoo()[n]) == folder]
        assert _skeleton_and_mixer(name) in {_skeleton_and_mixer(n) for n in kin}, (name, kin)
