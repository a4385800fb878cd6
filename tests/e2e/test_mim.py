"""OpenMMLab's ``mim`` launcher drives a linattn_mm config with the stock mmdet tools: ``mim train
mmdet CONFIG`` and ``mim test mmdet CONFIG --checkpoint CKPT`` run mmdet's own ``tools/train.py``
and ``tools/test.py`` (shipped in mmdet's ``.mim`` folder); the config's ``custom_imports`` brings
in linattn_mm. The stock tools take no ``--demo`` flag: ``python -m linattn_mm.demo CONFIG -o FILE``
writes the config on the demo data (the demo overlay). One short epoch on two demo images, then a
test pass on two images."""
import os
import os.path as osp
import shutil
import subprocess
import sys

import pytest
from harness import CONFIGS, REPO, run_tool

try:
    import mim  # noqa: F401
    _MIM_ERROR = None
except Exception as e:  # pragma: no cover - depends on the environment
    _MIM_ERROR = f'{type(e).__name__}: {e}'

pytestmark = pytest.mark.skipif(
    _MIM_ERROR is not None,
    reason=f'openmim is not importable ({_MIM_ERROR}); tools/bootstrap.sh installs it '
    '(pip install --no-deps openmim colorama tabulate pandas requests)')

CONFIG = osp.join(CONFIGS, 'pvtv2', 'mask-rcnn_pvtv2-b0_fpn_1x_coco.py')
# few proposals and sampled RoIs, no validation pass during training: the model is unchanged
FAST = ['model.train_cfg.rpn_proposal.nms_pre=200', 'model.train_cfg.rpn_proposal.max_per_img=64',
        'model.train_cfg.rcnn.sampler.num=64', 'model.test_cfg.rpn.nms_pre=200',
        'model.test_cfg.rpn.max_per_img=64', 'model.test_cfg.rcnn.score_thr=0.0']
TRAIN_OPTS = ['train_cfg.max_epochs=1', 'train_cfg.val_begin=100',
              'train_dataloader.batch_size=2', 'train_dataloader.dataset.indices=2',
              'val_dataloader.dataset.indices=2', 'default_hooks.checkpoint.save_optimizer=False'
              ] + FAST
TEST_OPTS = ['test_dataloader.dataset.indices=2'] + FAST


def _mim(args, timeout=600):
    """``mim ARGS`` from the repository root (the demo data root is relative to it), with
    the venv's interpreter first on PATH (mim runs the tool scripts with ``python``)."""
    exe = shutil.which('mim', path=osp.dirname(sys.executable)) or shutil.which('mim')
    cmd = [exe] if exe else [sys.executable, '-m', 'mim']
    env = dict(os.environ, PYTHONUNBUFFERED='1',
               PATH=osp.dirname(sys.executable) + os.pathsep + os.environ.get('PATH', ''))
    res = subprocess.run(cmd + args, cwd=REPO, capture_output=True, text=True, env=env,
                         timeout=timeout)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f'mim {" ".join(args[:2])} exited {res.returncode}:\n{out[-5000:]}'
    return out


def test_mim_train_and_test_mmdet(demo_data, tmp_path):
    demo = str(tmp_path / 'mask-rcnn_pvtv2-b0_fpn_1x_coco_demo.py')
    out = run_tool(['-m', 'linattn_mm.demo', CONFIG, '-o', demo])
    assert demo in out.splitlines() and osp.isfile(demo), out
    work = str(tmp_path / 'work')
    out = _mim(['train', 'mmdet', demo, '--gpus', '0', '--work-dir', work, '--cfg-options']
               + TRAIN_OPTS)
    assert 'Saving checkpoint' in out, out[-3000:]
    with open(osp.join(work, 'last_checkpoint')) as f:
        ckpt = f.read().strip()
    assert osp.isfile(ckpt), ckpt
    out = _mim(['test', 'mmdet', demo, '--gpus', '0', '--checkpoint', ckpt, '--work-dir', work,
                '--cfg-options'] + TEST_OPTS)
    assert 'coco/bbox_mAP' in out, out[-3000:]
