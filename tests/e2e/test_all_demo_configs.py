"""Every config of the model zoo, put on the demo data by the demo overlay (``--demo``), trains one
iteration and tests with metrics, through tools/train.py and tools/test.py (run in this process to
save start-up time); the ImageNet variants listed in ``IN1K_VARIANTS`` are built in their demo form
and run forward instead, and the configs of ``DEMO_TWINS`` are checked to have their trained twin's
demo form."""
import functools
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
# A 3x-schedule config whose demo form is its 1x twin's: the demo overlay replaces the schedule
# and the pipelines, and the two differ only in the top-level ``max_epochs`` variable the stock
# schedule reads (test_demo_twins_are_the_same_run checks it). The twin trains; this one does not
# train again.
DEMO_TWINS = {f'mask-rcnn_{b}_fpn_ms-crop-3x_coco': f'mask-rcnn_{b}_fpn_1x_coco' for b in (
    'deit-t', 'nalaformer-s', 'nalaformer-t', 'padre-pvt-t', 'padre-swin-t', 'pola-swin-t',
    'pvt-t', 'pvtv2-b0', 'setformer-t', 'swin-t')}
TRAINED = [n for n in CONFIGS if n not in IN1K_VARIANTS and n not in DEMO_TWINS]


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


@functools.lru_cache(maxsize=None)  # a config's demo form is read once (about 0.3 s each)
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


def test_demo_twins_are_the_same_run():
    """Each config of ``DEMO_TWINS`` has the same demo form as its trained twin, but for the
    top-level ``max_epochs`` (36 against 12), which the overlay's schedule does not read."""
    for name, twin in DEMO_TWINS.items():
        assert name in CONFIGS and twin in TRAINED, (name, twin)
        a, b = (demo_form(_zoo()[n]).to_dict() for n in (name, twin))
        assert (a.pop('max_epochs'), b.pop('max_epochs')) == (36, 12), name
        assert a == b, name
