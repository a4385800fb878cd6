"""Every demo config in the model zoo trains one iteration and tests with metrics on the demo
data, through tools/train.py and tools/test.py (run in this process to save start-up time)."""
import os.path as osp

import pytest

import linattn_mm
from conftest import train_and_test_inprocess
from linattn_mm.apis import _zoo

DEMOS = sorted(n for n in _zoo() if n.endswith('_demo'))


@pytest.mark.parametrize('name', DEMOS)
def test_demo_config_trains_and_tests(name, demo_data, fast_config_text, tmp_path):
    metrics, keys = train_and_test_inprocess(_zoo()[name], str(tmp_path / 'work'))
    for k in keys:
        assert k in metrics, (k, metrics)
        assert 0.0 <= metrics[k] <= 100.0, (k, metrics[k])


def test_every_full_config_has_a_demo_variant():
    full = [n for n in linattn_mm.list_models() if not n.endswith('_demo')]
    # variants of one arch (e.g. swin-s_in1k) share the demo of their family's tiny config
    families = {osp.dirname(_zoo()[n]) for n in full}
    for fam in families:
        demos = [n for n in DEMOS if osp.dirname(_zoo()[n]) == fam]
        dense = [n for n in full if osp.dirname(_zoo()[n]) == fam and not n.endswith('_in1k')]
        for n in dense:
            assert n + '_demo' in demos, f'{n} has no demo variant'
        assert any(n.endswith('_in1k_demo') for n in demos), f'{fam}: no ImageNet demo'
