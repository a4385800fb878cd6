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


@pytest.mark.parametrize('env_extra,want', [
    ({}, 'venv'), ({'PYTHON': 'CHOSEN'}, 'chosen'), ({'VIRTUAL_ENV': '/some/env'}, 'path')])
def test_launch_scripts_pick_the_projects_environment(tmp_path, env_extra, want):
    """Without PYTHON set and outside an activated environment, the launch scripts run the
    project's .venv python (which the README's set-up makes), not whatever ``python`` is on PATH;
    PYTHON, or an activated virtual / conda environment, takes precedence."""
    import shutil
    import stat
    root = tmp_path / 'repo'
    (root / 'tools').mkdir(parents=True)
    bindir = tmp_path / 'bin'
    for script in ('dist_train.sh', 'dist_test.sh', 'dist_python.sh'):
        shutil.copy(osp.join(REPO, 'tools', script), root / 'tools' / script)
    log = tmp_path / 'calls.txt'

    def fake(path, tag):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'#!/usr/bin/env bash\necho "{tag} $*" >> {log}\n')
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    fake(root / '.venv' / 'bin' / 'python', 'venv')
    fake(bindir / 'python', 'path')
    fake(bindir / 'CHOSEN', 'chosen')
    env = {k: v for k, v in os.environ.items()
           if k not in ('PYTHON', 'VIRTUAL_ENV', 'CONDA_PREFIX')}
    env.update(env_extra, PATH=f'{bindir}:{env["PATH"]}')
    for args in (['dist_train.sh', 'cfg.py', '2'], ['dist_test.sh', 'cfg.py', 'w.pth', '2']):
        res = subprocess.run(['bash', str(root / 'tools' / args[0])] + args[1:], env=env,
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
    calls = log.read_text().splitlines()
    tools = str(root / 'tools')
    assert calls == [
        f'{want} -m torch.distributed.run --nnodes=1 --node_rank=0 --master_addr=127.0.0.1 '
        f'--master_port=29500 --nproc_per_node=2 {tools}/train.py cfg.py --launcher pytorch',
        f'{want} -m torch.distributed.run --nnodes=1 --node_rank=0 --master_addr=127.0.0.1 '
        f'--master_port=29500 --nproc_per_node=2 {tools}/test.py cfg.py w.pth --launcher pytorch']
