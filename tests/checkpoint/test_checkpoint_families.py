"""A checkpoint of one family loaded into another: one clear error (nothing matches, or shapes
that cannot be resized), or a load whose missing / unexpected keys are reported and logged as a
warning. Never a silent partial load."""
import itertools
import logging

import pytest
import torch
from families import FAMILIES

from linattn_mm.checkpoint import CheckpointError, load_pretrained

NAMES = ['swin-softmax', 'pola-swin', 'padre-swin', 'poly-swin', 'pvt-softmax', 'pola-pvt',
         'nalaformer', 'setformer', 'r50-polynl', 'deit-softmax']


@pytest.fixture(scope='module')
def state_dicts():
    out = {}
    for n in NAMES:
        torch.manual_seed(0)
        out[n] = {k: v.clone() for k, v in FAMILIES[n]().state_dict().items()}
    return out


@pytest.mark.parametrize('src,dst', [p for p in itertools.permutations(NAMES, 2)],
                         ids=lambda v: v)
def test_other_family_checkpoint_is_an_error_or_a_reported_warning(state_dicts, src, dst, caplog):
    model = FAMILIES[dst]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    logger = logging.getLogger('linattn_family_ckpt')
    try:
        with caplog.at_level(logging.INFO, logger='linattn_family_ckpt'):
            report = load_pretrained(model, state_dicts[src], logger=logger)
    except CheckpointError as e:
        msg = str(e)
        assert len(msg) > 40 and ("'" in msg), msg  # names the key or the problem
        # an error loads nothing
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        return
    assert report.missing or report.unexpected, f'{src} -> {dst} loaded silently'
    warnings_logged = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings_logged, 'missing / unexpected keys must be logged as a warning'
    text = warnings_logged[0].getMessage()
    assert f'{len(report.missing)} missing' in text and f'{len(report.unexpected)} unexpected' in text
