"""tools/dist_train.sh with 2 CPU processes (gloo) gives the same weights as one process with the
same global batch: DDP averages the two half-batch gradients into the full-batch gradient, and the
distributed sampler splits each global batch between the ranks. Run for a stock backbone and for a
Pola one in its default training form (the lean autograd Functions of the core, conv term, gated
projection and FFN)."""
import os
import os.path as osp
import socket
import subprocess
import sys

import pytest
import torch
from harness import CONFIGS, REPO, run_tool

from linattn_mm.checkpoint import safe_globals
from linattn_mm.demo import write_demo_config

CONFIG = '''
_base_ = ['{base}']
train_dataloader = dict(dataset=dict(
    indices=16, pipeline={{{{_base_.test_dataloader.dataset.pipeline}}}}))
model = dict(backbone=dict(drop_path_rate=0.0), train_cfg=None)
train_cfg = dict(max_epochs=1, val_interval=100)
randomness = dict(seed=0, deterministic=True)
'''


def _weights(path):
    with safe_globals():  # runner checkpoints hold mmengine HistoryBuffers
        return torch.load(path, map_location='cpu', weights_only=True)['state_dict']


def free_port():
    """A TCP port free on this machine now (the cases may run side by side)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.mark.parametrize('config', ['pvtv2/pvtv2-b0_in1k.py', 'polaformer/pola-pvt-t_in1k.py'])
def test_two_process_training_matches_one_process(demo_data, tmp_path, config):
    cfg = tmp_path / 'dist_cfg.py'
    # the classifier on the demo data: the one-file config of the demo overlay (the mim route)
    name = osp.splitext(osp.basename(config))[0]
    base = write_demo_config(osp.join(CONFIGS, config), str(tmp_path / f'{name}_demo.py'))
    cfg.write_text(CONFIG.format(base=base))
    one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
    cpu = dict(CUDA_VISIBLE_DEVICES='')  # both runs on CPU, also on a GPU machine
    run_tool(['tools/train.py', str(cfg), '--work-dir', one,
              '--cfg-options', 'train_dataloader.batch_size=4'], env=cpu)
    env = dict(os.environ, PYTHON=sys.executable, PORT=str(free_port()), **cpu)
    res = subprocess.run(['bash', 'tools/dist_train.sh', str(cfg), '2', '--work-dir', two,
                          '--cfg-options', 'train_dataloader.batch_size=2'],
                         cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    a, b = _weights(osp.join(one, 'epoch_1.pth')), _weights(osp.join(two, 'epoch_1.pth'))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=5e-5, msg=k)


def test_launch_scripts_without_their_arguments_print_their_usage():
    for script, usage in (('dist_train.sh', 'CONFIG NPROC [train.py args ...]'),
                          ('dist_test.sh', 'CONFIG CHECKPOINT NPROC [test.py args ...]')):
        res = subprocess.run(['bash', f'tools/{script}', 'only-a-config'], cwd=REPO,
                             capture_output=True, text=True)
        assert res.returncode == 2
        assert res.stderr.strip() == f'usage: bash tools/{script} {usage}'
