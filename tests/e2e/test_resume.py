"""A training run killed mid-way and restarted with --resume reaches the same weights as an
uninterrupted run (deterministic mode, same seed). This also exercises loading mmengine's own
checkpoints (message hub, optimizer and scheduler state) under torch.load(weights_only=True)."""
import os
import os.path as osp
import signal
import subprocess
import sys
import time

import torch
from harness import CONFIGS, REPO, run_tool

from linattn_mm.checkpoint import safe_globals
from linattn_mm.demo import write_demo_config

# A classifier on the demo ImageNet subset with no random augmentation, stochastic depth or
# mixup, so that the only state a resume must restore is the model, optimizer, schedulers, epoch
# counter and data order.
CONFIG = '''
_base_ = ['{base}']
train_dataloader = dict(batch_size=4, dataset=dict(
    indices=16, pipeline={{{{_base_.test_dataloader.dataset.pipeline}}}}))
val_dataloader = dict(dataset=dict(indices=4))
test_dataloader = dict(dataset=dict(indices=4))
model = dict(backbone=dict(drop_path_rate=0.0), train_cfg=None)
train_cfg = dict(max_epochs=3, val_interval=100)
default_hooks = dict(checkpoint=dict(interval=1, max_keep_ckpts=5))
randomness = dict(seed=0, deterministic=True)
'''


def _weights(path):
    with safe_globals():  # runner checkpoints hold mmengine HistoryBuffers
        sd = torch.load(path, map_location='cpu', weights_only=True)['state_dict']
    return {k: v for k, v in sd.items() if v.is_floating_point()}


def test_resume_after_kill_matches_uninterrupted(demo_data, tmp_path):
    cfg = tmp_path / 'resume_cfg.py'
    # the classifier on the demo data: the one-file config of the demo overlay (the mim route)
    base = write_demo_config(osp.join(CONFIGS, 'pvtv2', 'pvtv2-b0_in1k.py'),
                             str(tmp_path / 'pvtv2-b0_in1k_demo.py'))
    cfg.write_text(CONFIG.format(base=base))
    full, cut = str(tmp_path / 'full'), str(tmp_path / 'cut')
    run_tool(['tools/train.py', str(cfg), '--work-dir', full])

    # start the same run and kill it (SIGKILL) as soon as the second epoch's checkpoint starts
    # being written: that file may be truncated, so the resume must use a complete one
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    proc = subprocess.Popen([sys.executable, 'tools/train.py', str(cfg), '--work-dir', cut],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not osp.exists(osp.join(cut, 'epoch_2.pth')) and proc.poll() is None:
        assert time.time() < deadline, 'no checkpoint appeared'
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not osp.exists(osp.join(cut, 'epoch_3.pth')), 'the run finished before it was killed'

    out = run_tool(['tools/train.py', str(cfg), '--work-dir', cut, '--resume'])
    assert '--resume: resuming from' in out and 'resumed epoch' in out
    a, b = _weights(osp.join(full, 'epoch_3.pth')), _weights(osp.join(cut, 'epoch_3.pth'))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    # and the weights did change during training
    first = _weights(osp.join(full, 'epoch_1.pth'))
    assert any(not torch.equal(first[k], a[k]) for k in a)


def test_find_resume_checkpoint_skips_truncated_files(tmp_path):
    from linattn_mm.cli import find_resume_checkpoint, is_complete_checkpoint
    assert find_resume_checkpoint(str(tmp_path)) is None
    for n in (1, 2, 3):
        torch.save({'state_dict': {'w': torch.full((64, 64), float(n))}}, tmp_path / f'epoch_{n}.pth')
    (tmp_path / 'last_checkpoint').write_text(str(tmp_path / 'epoch_2.pth'))
    assert find_resume_checkpoint(str(tmp_path)) == str(tmp_path / 'epoch_3.pth')
    data = (tmp_path / 'epoch_3.pth').read_bytes()
    (tmp_path / 'epoch_3.pth').write_bytes(data[:len(data) // 2])  # killed while saving
    assert not is_complete_checkpoint(str(tmp_path / 'epoch_3.pth'))
    assert find_resume_checkpoint(str(tmp_path)) == str(tmp_path / 'epoch_2.pth')


def test_find_resume_checkpoint_reads_only_the_newest_files(tmp_path, monkeypatch):
    """Checking a checkpoint reads the whole file: the search stops at the newest complete one
    (a work dir of a long run keeps hundreds of them) and checks the pointer's file only when it
    names a newer one."""
    import linattn_mm.cli as cli
    for n in range(1, 7):
        torch.save({'state_dict': {'w': torch.zeros(4)}}, tmp_path / f'epoch_{n}.pth')
    (tmp_path / 'epoch_6.pth').write_bytes(b'truncated')
    (tmp_path / 'last_checkpoint').write_text(str(tmp_path / 'epoch_5.pth'))
    checked = []
    real = cli.is_complete_checkpoint
    monkeypatch.setattr(cli, 'is_complete_checkpoint', lambda p: checked.append(p) or real(p))
    assert cli.find_resume_checkpoint(str(tmp_path)) == str(tmp_path / 'epoch_5.pth')
    assert checked == [str(tmp_path / 'epoch_6.pth'), str(tmp_path / 'epoch_5.pth')]
